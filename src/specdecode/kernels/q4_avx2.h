// The Q4 kernel for AVX2 CPUs without VPDPBUSD (included in cpu_kernels.cpp's k_avx2 region, after
// generic.h, whose q4_columns_generic defines the block layout and the folds).
//
// VPMADDUBSW multiplies a slice's codes (0..15) by four activation bytes of each column and adds
// pairs into 16-bit lanes. A group's eight such products are added in 16 bits, which is exact
// (|sum| <= 8 * 2 * 15 * 127 = 30480 < 2^15), and VPMADDWD by ones adds each column's two lanes
// into its 32-bit sum: the integer VPDPBUSD gives. The float folds are generic.h's, in its order,
// so every variant gives the same bits.

// R rows (at most 4) of one column tile, both halves (8 columns each): each unpacked slice of
// codes serves R rows, each broadcast of activation bytes both halves. The float accumulators
// are the caller's (in memory: touched once a group, they leave the registers to the 16-bit
// sums, 2R of them, and the four slices). `prefetch`: the pass that streams the tile from
// memory asks for it Q4_PREFETCH ahead; a later pass asks for its share of the next tile,
// `ahead` (ahead_of_pass), while it computes from cache.
template <int R>
static void q4_tile_avx2(const int8_t* xq, const float* dx, const float* sx, int64_t k_dim,
                         const uint8_t* tile, bool prefetch, Ahead ahead, __m256 (&acc)[R][2]) {
  const int64_t groups = k_dim / 32;
  const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
  for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; g++) {
    const uint8_t* blk = tile + g * Q4_BLOCK;
    if (prefetch)
      for (int line = 0; line < Q4_BLOCK; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(blk + Q4_PREFETCH + line), _MM_HINT_T0);
    for (int64_t line = 0; line < ahead.lines; line++)
      _mm_prefetch(reinterpret_cast<const char*>(ahead.at + (g * ahead.lines + line) * 64), _MM_HINT_T0);
    const int8_t* xg = xq + g * 32;
    __m256i sum[R][2];
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {
      __m256i lo[2], hi[2];
      for (int h = 0; h < 2; h++) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * j + 32 * h));
        lo[h] = _mm256_and_si256(v, low);
        hi[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; r++) {
        int32_t a, b;
        std::memcpy(&a, xg + r * k_dim + 4 * j, 4);
        std::memcpy(&b, xg + r * k_dim + 16 + 4 * j, 4);
        const __m256i xa = _mm256_set1_epi32(a), xb = _mm256_set1_epi32(b);
        for (int h = 0; h < 2; h++) {
          const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo[h], xa), _mm256_maddubs_epi16(hi[h], xb));
          sum[r][h] = j ? _mm256_add_epi16(sum[r][h], p) : p;
        }
        // a row's products are added as they are made: left free, GCC computes the four
        // slices' products of every row first and spills them (a third slower from 4 rows)
        if (R > 1) asm volatile("" : "+x"(sum[r][0]), "+x"(sum[r][1]));
      }
    }
    for (int h = 0; h < 2; h++) {
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 256 + 16 * h)));
      const __m256 mn = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 288 + 16 * h)));
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

// block int8's and the small codes' AVX2 passes (q8_blocks.h, small_codes.h), for m rows of one
// column tile: up to 4 rows in one pass over both halves (each unpacked slice of
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

// column tiles t0 .. t1 for m rows, each tile in passes of up to 4 rows over both halves: the
// first streams the tile, the later ones read it from cache and ask for the next tile
static void q4_columns_avx2(const int8_t* xq, const float* dx, const float* sx, int64_t m,
                            int64_t k_dim, const uint8_t* packed, const float* residual,
                            float* y, int64_t n, int64_t t0, int64_t t1) {
  const int64_t groups = k_dim / 32, tile_bytes = groups * Q4_BLOCK, passes = (m + 3) / 4;
  for (int64_t t = t0; t < t1; t++) {
    const uint8_t* tile = packed + t * tile_bytes;
    const uint8_t* next = t + 1 < t1 ? tile + tile_bytes : nullptr;
    for (int64_t r0 = 0; r0 < m; r0 += 4) {
      const Ahead ahead = ahead_of_pass(r0 / 4, passes, next, tile_bytes / 64, groups);
      auto pass = [&](auto rows) {
        constexpr int R = decltype(rows)::value;
        __m256 acc[R][2];
        q4_tile_avx2<R>(xq + r0 * k_dim, dx + r0 * groups, sx + r0 * groups, k_dim, tile, r0 == 0,
                        ahead, acc);
        store_halves_avx2<R, 2>(acc, r0, t * 16, residual, y, n);
      };
      switch (std::min<int64_t>(4, m - r0)) {
        case 4: pass(std::integral_constant<int, 4>{}); break;
        case 3: pass(std::integral_constant<int, 3>{}); break;
        case 2: pass(std::integral_constant<int, 2>{}); break;
        default: pass(std::integral_constant<int, 1>{}); break;
      }
    }
  }
}
