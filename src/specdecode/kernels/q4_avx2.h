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
// streams the tile from memory asks for it Q4_PREFETCH ahead.
template <int R, int H>
static void q4_tile_avx2(const int8_t* xq, const float* dx, const float* sx, int64_t k_dim,
                         const uint8_t* tile, int h0, bool prefetch, __m256 (&acc)[R][H]) {
  const int64_t groups = k_dim / 32;
  const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
  for (int r = 0; r < R; r++)
    for (int h = 0; h < H; h++) acc[r][h] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; g++) {
    const uint8_t* blk = tile + g * Q4_BLOCK;
    if (prefetch)
      for (int line = 0; line < Q4_BLOCK; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(blk + Q4_PREFETCH + line), _MM_HINT_T0);
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

// m rows of one column tile in passes of up to 4 rows over one half (the registers hold 4 rows'
// sums of a half beside the codes): pass(rows, r0, h, first), rows a std::integral_constant,
// `first` the pass that streams the tile (the others read it from cache)
template <class Pass>
static inline void half_passes(int64_t m, Pass&& pass) {
  for (int64_t r0 = 0; r0 < m; r0 += 4)
    for (int h = 0; h < 2; h++) {
      const bool first = r0 == 0 && h == 0;
      switch (std::min<int64_t>(4, m - r0)) {
        case 4: pass(std::integral_constant<int, 4>{}, r0, h, first); break;
        case 3: pass(std::integral_constant<int, 3>{}, r0, h, first); break;
        case 2: pass(std::integral_constant<int, 2>{}, r0, h, first); break;
        default: pass(std::integral_constant<int, 1>{}, r0, h, first); break;
      }
    }
}

// column tiles t0 .. t1 for m rows: one or two rows take both halves of a tile in one pass (it
// streams the tile once); more rows take half_passes
static void q4_columns_avx2(const int8_t* xq, const float* dx, const float* sx, int64_t m,
                            int64_t k_dim, const uint8_t* packed, const float* residual,
                            float* y, int64_t n, int64_t t0, int64_t t1) {
  const int64_t groups = k_dim / 32, tile_bytes = groups * Q4_BLOCK;
  for (int64_t t = t0; t < t1; t++) {
    const uint8_t* tile = packed + t * tile_bytes;
    if (m <= 2) {
      for (int64_t r0 = 0; r0 < m; r0++) {
        __m256 acc[1][2];
        q4_tile_avx2<1, 2>(xq + r0 * k_dim, dx + r0 * groups, sx + r0 * groups, k_dim, tile, 0,
                           r0 == 0, acc);
        store_halves_avx2<1, 2>(acc, r0, t * 16, residual, y, n);
      }
      continue;
    }
    half_passes(m, [&](auto rows, int64_t r0, int h, bool first) {
      constexpr int R = decltype(rows)::value;
      __m256 acc[R][1];
      q4_tile_avx2<R, 1>(xq + r0 * k_dim, dx + r0 * groups, sx + r0 * groups, k_dim, tile, h,
                         first, acc);
      store_halves_avx2<R, 1>(acc, r0, t * 16 + 8 * h, residual, y, n);
    });
  }
}
