// The Q4 kernel for AVX2 CPUs without VPDPBUSD (included in cpu_kernels.cpp's k_avx2 region, after
// generic.h, whose q4_columns_generic defines the block layout and the folds).
//
// VPMADDUBSW multiplies a slice's codes (0..15) by four activation bytes of each column and adds
// pairs into 16-bit lanes. A group's eight such products are added in 16 bits, which is exact
// (|sum| <= 8 * 2 * 15 * 127 = 30480 < 2^15), and VPMADDWD by ones adds each column's two lanes
// into its 32-bit sum: the integer VPDPBUSD gives. The float folds are generic.h's, in its order,
// so every variant gives the same bits.

// R rows x H halves (8 columns each, from half h0) of one column tile: each unpacked slice of
// codes serves R rows, each broadcast of activation bytes H halves. `prefetch`: the pass that
// streams the tile from memory asks for it Q4_PREFETCH ahead; a later pass asks for its share
// of the next tile, `ahead` (ahead_of_pass), while it computes from cache.
template <int R, int H>
static void q4_tile_avx2(const int8_t* xq, const float* dx, const float* sx, int64_t k_dim,
                         const uint8_t* tile, int h0, bool prefetch, Ahead ahead,
                         __m256 (&acc)[R][H]) {
  const int64_t groups = k_dim / 32;
  const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
  for (int r = 0; r < R; r++)
    for (int h = 0; h < H; h++) acc[r][h] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; g++) {
    const uint8_t* blk = tile + g * Q4_BLOCK;
    if (prefetch)
      for (int line = 0; line < Q4_BLOCK; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(blk + Q4_PREFETCH + line), _MM_HINT_T0);
    for (int64_t line = 0; line < ahead.lines; line++)
      _mm_prefetch(reinterpret_cast<const char*>(ahead.at + (g * ahead.lines + line) * 64), _MM_HINT_T0);
    __m256i sum[R][H];
    for (int j = 0; j < 4; j++) {
      __m256i lo[H], hi[H];
      for (int h = 0; h < H; h++) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * j + 32 * (h0 + h)));
        lo[h] = _mm256_and_si256(v, low);
        hi[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      }
      for (int r = 0; r < R; r++) {
        const int8_t* xg = xq + r * k_dim + g * 32;
        int32_t a, b;
        std::memcpy(&a, xg + 4 * j, 4);
        std::memcpy(&b, xg + 16 + 4 * j, 4);
        const __m256i xa = _mm256_set1_epi32(a), xb = _mm256_set1_epi32(b);
        for (int h = 0; h < H; h++) {
          const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo[h], xa), _mm256_maddubs_epi16(hi[h], xb));
          sum[r][h] = j ? _mm256_add_epi16(sum[r][h], p) : p;
        }
      }
    }
    for (int h = 0; h < H; h++) {
      const int64_t half = 8 * (h0 + h);
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 256 + 2 * half)));
      const __m256 mn = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 288 + 2 * half)));
      for (int r = 0; r < R; r++) {
        const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(dx[r * groups + g]));
        const __m256 isum = _mm256_cvtepi32_ps(_mm256_madd_epi16(sum[r][h], ones));
        acc[r][h] = _mm256_fmadd_ps(isum, scale, acc[r][h]);
        acc[r][h] = _mm256_fmadd_ps(mn, _mm256_set1_ps(sx[r * groups + g]), acc[r][h]);
      }
    }
  }
}

// y[r0 .., the halves' columns] = residual + acc (columns from n on are not stored)
template <int R, int H>
static void store_halves_avx2(const __m256 (&acc)[R][H], int64_t r0, int64_t col0,
                              const float* residual, float* y, int64_t n) {
  for (int r = 0; r < R; r++)
    for (int h = 0; h < H; h++) {
      const int64_t col = col0 + 8 * h, at = (r0 + r) * n + col, live = std::min<int64_t>(8, n - col);
      if (live <= 0) continue;
      alignas(32) float out[8];
      __m256 v = acc[r][h];
      if (residual && live == 8) v = _mm256_add_ps(_mm256_loadu_ps(residual + at), v);
      if (live == 8) {
        _mm256_storeu_ps(y + at, v);
        continue;
      }
      _mm256_store_ps(out, v);
      for (int c = 0; c < live; c++) y[at + c] = residual ? residual[at + c] + out[c] : out[c];
    }
}

// m rows of one column tile: up to 4 rows in one pass over both halves (each unpacked slice of
// codes serves every row, and the tile streams once), more in passes of up to 4 rows over one
// half (the registers hold 4 rows' sums of a half beside the codes; measured faster from 8
// rows). pass(rows, halves, r0, h0, first, ahead), rows and halves std::integral_constants,
// `first` the pass that streams the tile (the others read it from cache and ask for their
// `ahead` share of the next tile's `lines` cache lines at `next`, null if none)
template <class Pass>
static inline void row_passes(int64_t m, const uint8_t* next, int64_t lines, int64_t groups,
                              Pass&& pass) {
  using one = std::integral_constant<int, 1>;
  using two = std::integral_constant<int, 2>;
  using three = std::integral_constant<int, 3>;
  using four = std::integral_constant<int, 4>;
  if (m <= 4) {
    const Ahead none{nullptr, 0};
    switch (m) {
      case 4: pass(four{}, two{}, 0, 0, true, none); break;
      case 3: pass(three{}, two{}, 0, 0, true, none); break;
      case 2: pass(two{}, two{}, 0, 0, true, none); break;
      default: pass(one{}, two{}, 0, 0, true, none); break;
    }
    return;
  }
  const int64_t passes = 2 * ((m + 3) / 4);
  for (int64_t r0 = 0; r0 < m; r0 += 4)
    for (int h = 0; h < 2; h++) {
      const int64_t index = r0 / 2 + h;
      const Ahead ahead = ahead_of_pass(index, passes, next, lines, groups);
      switch (std::min<int64_t>(4, m - r0)) {
        case 4: pass(four{}, one{}, r0, h, index == 0, ahead); break;
        case 3: pass(three{}, one{}, r0, h, index == 0, ahead); break;
        case 2: pass(two{}, one{}, r0, h, index == 0, ahead); break;
        default: pass(one{}, one{}, r0, h, index == 0, ahead); break;
      }
    }
}

// column tiles t0 .. t1 for m rows, each tile in row_passes
static void q4_columns_avx2(const int8_t* xq, const float* dx, const float* sx, int64_t m,
                            int64_t k_dim, const uint8_t* packed, const float* residual,
                            float* y, int64_t n, int64_t t0, int64_t t1) {
  const int64_t groups = k_dim / 32, tile_bytes = groups * Q4_BLOCK;
  for (int64_t t = t0; t < t1; t++) {
    const uint8_t* tile = packed + t * tile_bytes;
    const uint8_t* next = t + 1 < t1 ? tile + tile_bytes : nullptr;
    row_passes(m, next, tile_bytes / 64, groups,
               [&](auto rows, auto halves, int64_t r0, int h0, bool first, Ahead ahead) {
      constexpr int R = decltype(rows)::value, H = decltype(halves)::value;
      __m256 acc[R][H];
      q4_tile_avx2<R, H>(xq + r0 * k_dim, dx + r0 * groups, sx + r0 * groups, k_dim, tile, h0,
                         first, ahead, acc);
      store_halves_avx2<R, H>(acc, r0, t * 16 + 8 * h0, residual, y, n);
    });
  }
}
