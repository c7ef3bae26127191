// Block int8 weights times int8 activations (models/int8_blocks.py): w = scale * code
// (+ minimum) per group of G = 16 or 32 inputs, codes -128..127, scales and minimums float32
// (or float16).
// Included once by cpu_kernels.cpp, after its activation quantisers (quantise_rows and the
// AVX-512 quantise_rows_avx512, per row and per 32 inputs: x ~ dx * xq).
//
// Packed weights (kernels.pack_q8_blocks), uint8 [N / 16, K / G, B]: one block per 16-column
// tile and group, B = 16 G + 16 S (+ 16 S) bytes: G / 4 slices of 64 bytes whose byte 4c + i
// holds code + 128 of input 4j + i of column c (VPDPBUSD's operand order: unsigned bytes, four
// inputs of a column in a lane), then the 16 columns' scales, then their minimums, each S = 4
// bytes (float32) or, where every one of them is a float16 number (Q8_0, Q4_0, Q4_1, Q5_0,
// Q5_1, and --weights int8), S = 2 (float16, read exactly as float32: the same numbers).
//
// Per row, column and group the integer dot product is exact:
//   isum = sum_i (code_i + 128) xq_i - 128 sum_i xq_i = sum_i code_i xq_i,
// and the group is folded into the column's float sum, group after group:
//   acc = fma((float)isum, scale * dx, acc);  acc = fma(minimum, dx * sum_i xq_i, acc)
// (dx: the row's scale of the 32 activations holding the group). Integer sums are exact in any
// order, so only these float operations order the result: they depend on K and G alone, so a
// row's output is the same in a call of any size and position, and the portable, AVX2 and
// AVX-512 VNNI variants give the same bits.

// how far ahead of the block in use the first row pass asks for a tile's weights (bytes), as
// the Q4 kernel does with Q4_PREFETCH (where the hardware prefetcher alone was measured to leave
// one row waiting on memory); about the Q4 kernel's distance, not tuned for these blocks
#define Q8_PREFETCH 4096
// the fewest rows for which groups of 32 take the AMX tiles (where the CPU has them)
#ifndef Q8_AMX_MIN_ROWS
#define Q8_AMX_MIN_ROWS 7
#endif

namespace q8blocks {

constexpr int64_t block_bytes(int64_t group, bool minimum, bool half) {
  return group * 16 + (half ? 32 : 64) * (minimum ? 2 : 1);
}

// the 16 float32 numbers at `at`: float32, or float16 widened exactly
template <bool HALF>
static inline void load_scales(const uint8_t* at, float* out) {
  if (HALF) {
    uint16_t h[16];
    std::memcpy(h, at, 32);
    for (int c = 0; c < 16; c++) out[c] = k_generic::half_to_float(h[c]);
  } else {
    std::memcpy(out, at, 64);
  }
}

// a call's activations, quantised per row and per 32 inputs, with the per-group sums that the
// codes' +128 offset and the minimums need
struct Acts {
  const int8_t* xq;     // [m, k]
  const float* dx;      // [m, k / 32]
  const int32_t* bias;  // [m, k / G]: -128 * sum of the group's xq
  const float* sx;      // [m, k / G]: dx * sum of the group's xq
  int64_t k;
};

// the portable kernel (baseline x86-64)
template <int G, bool MIN, bool HALF>
static void columns_generic(
    const Acts& a, int64_t m, const uint8_t* packed, const float* residual, float* y,
    int64_t n, int64_t t0, int64_t t1) {
  constexpr int64_t B = block_bytes(G, MIN, HALF), S = HALF ? 32 : 64;
  const int64_t groups = a.k / G, agroups = a.k / 32;
  for (int64_t t = t0; t < t1; t++) {
    for (int64_t r = 0; r < m; r++) {
      float acc[16] = {};
      for (int64_t g = 0; g < groups; g++) {
        const uint8_t* blk = packed + (t * groups + g) * B;
        const int8_t* xg = a.xq + r * a.k + g * G;
        int32_t isum[16];
        for (int c = 0; c < 16; c++) isum[c] = a.bias[r * groups + g];
        for (int j = 0; j < G / 4; j++)
          for (int c = 0; c < 16; c++)
            for (int i = 0; i < 4; i++) isum[c] += (int32_t)blk[64 * j + 4 * c + i] * xg[4 * j + i];
        float scale[16], minimum[16];
        load_scales<HALF>(blk + 16 * G, scale);
        const float gx = a.dx[r * agroups + g * G / 32];
        for (int c = 0; c < 16; c++) acc[c] = FMA((float)isum[c], scale[c] * gx, acc[c]);
        if (MIN) {
          load_scales<HALF>(blk + 16 * G + S, minimum);
          const float gs = a.sx[r * groups + g];
          for (int c = 0; c < 16; c++) acc[c] = FMA(minimum[c], gs, acc[c]);
        }
      }
      for (int c = 0; c < 16 && t * 16 + c < n; c++) {
        const int64_t at = r * n + t * 16 + c;
        y[at] = residual ? residual[at] + acc[c] : acc[c];
      }
    }
  }
}

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

// Where halves_avx2 reads a group's codes: block int8's bytes, code + 128 in VPDPBUSD's order
// (small_codes.h's codebook layouts give another source: the codes' 4-bit indices)
struct ByteCodes {
  // bytes of a group's codes; its scales follow them
  static constexpr int64_t code_bytes(int group) { return 16 * group; }
  // slice j (4 inputs of 16 columns) of half h (8 columns) of the group at `blk`: the codes
  static inline __m256i slice(const uint8_t* blk, int j, int h) {
    return _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * j + 32 * h)),
                            _mm256_set1_epi8((char)0x80));
  }
};

// 8 columns' float32 numbers at `at` (float32, or float16 widened exactly)
template <bool HALF>
static inline __m256 numbers8(const uint8_t* at) {
  if constexpr (HALF) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)));
  else return _mm256_loadu_ps(reinterpret_cast<const float*>(at));
}

// R rows x H halves (8 columns each, from half h0) of one column tile, for CPUs without VPDPBUSD.
// VPMADDUBSW takes an unsigned and a signed operand, and code + 128 times xq would overflow its
// 16-bit pairs, so it multiplies |code| (0..128) by xq carrying the code's sign (-127..127):
// each pair is code * xq summed over two inputs, |pair| <= 2 x 128 x 127 < 2^15, exact;
// VPMADDWD by ones adds a column's pairs into its 32-bit sum. The group's integer is VPDPBUSD's
// (sum of code * xq) and the folds are columns_vnni's. `prefetch`: the pass that streams the
// tile asks for it Q8_PREFETCH bytes ahead; a later pass asks for its share of the next tile,
// `ahead`. `codes`: where the codes are read (ByteCodes).
template <int G, bool MIN, bool HALF, int R, int H, class Codes = ByteCodes>
static void halves_avx2(const Acts& a, int64_t r0, const uint8_t* tile, int h0, bool prefetch,
                        Ahead ahead, __m256 (&acc)[R][H], const Codes& codes) {
  constexpr int64_t C = Codes::code_bytes(G), S = HALF ? 32 : 64, B = C + S * (MIN ? 2 : 1);
  const int64_t groups = a.k / G, agroups = a.k / 32;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int r = 0; r < R; r++)
    for (int h = 0; h < H; h++) acc[r][h] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; g++) {
    const uint8_t* blk = tile + g * B;
    if (prefetch)
      for (int64_t line = 0; line < B; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(blk + Q8_PREFETCH + line), _MM_HINT_T0);
    for (int64_t line = 0; line < ahead.lines; line++)
      _mm_prefetch(reinterpret_cast<const char*>(ahead.at + (g * ahead.lines + line) * 64), _MM_HINT_T0);
    __m256i isum[R][H];
    for (int r = 0; r < R; r++)
      for (int h = 0; h < H; h++) isum[r][h] = _mm256_setzero_si256();
    for (int j = 0; j < G / 4; j++) {
      __m256i code[H], magnitude[H];
      for (int h = 0; h < H; h++) {
        code[h] = codes.slice(blk, j, h0 + h);
        magnitude[h] = _mm256_abs_epi8(code[h]);
      }
      for (int r = 0; r < R; r++) {
        int32_t four;
        std::memcpy(&four, a.xq + (r0 + r) * a.k + g * G + 4 * j, 4);
        const __m256i x = _mm256_set1_epi32(four);
        for (int h = 0; h < H; h++) {
          const __m256i signed_x = _mm256_sign_epi8(x, code[h]);
          isum[r][h] = _mm256_add_epi32(isum[r][h], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude[h], signed_x), ones));
        }
      }
    }
    for (int h = 0; h < H; h++) {
      const __m256 scale = numbers8<HALF>(blk + C + (HALF ? 16 : 32) * (h0 + h));
      for (int r = 0; r < R; r++) {
        const __m256 sd = _mm256_mul_ps(scale, _mm256_set1_ps(a.dx[(r0 + r) * agroups + g * G / 32]));
        acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r][h]), sd, acc[r][h]);
      }
      if constexpr (MIN) {
        const __m256 minimum = numbers8<HALF>(blk + C + S + (HALF ? 16 : 32) * (h0 + h));
        for (int r = 0; r < R; r++)
          acc[r][h] = _mm256_fmadd_ps(minimum, _mm256_set1_ps(a.sx[(r0 + r) * groups + g]), acc[r][h]);
      }
    }
  }
}

// each tile in k_avx2::row_passes
template <int G, bool MIN, bool HALF, class Codes = ByteCodes>
static void columns_avx2(const Acts& a, int64_t m, const uint8_t* packed, const float* residual,
                         float* y, int64_t n, int64_t t0, int64_t t1, const Codes& codes = {}) {
  const int64_t groups = a.k / G;
  const int64_t tile_bytes = groups * (Codes::code_bytes(G) + (HALF ? 32 : 64) * (MIN ? 2 : 1));
  for (int64_t t = t0; t < t1; t++) {
    const uint8_t* tile = packed + t * tile_bytes;
    const uint8_t* next = t + 1 < t1 ? tile + tile_bytes : nullptr;
    k_avx2::row_passes(m, next, tile_bytes / 64, groups,
                       [&](auto rows, auto halves, int64_t r0, int h0, bool first, Ahead ahead) {
      constexpr int R = decltype(rows)::value, H = decltype(halves)::value;
      __m256 acc[R][H];
      halves_avx2<G, MIN, HALF, R, H, Codes>(a, r0, tile, h0, first, ahead, acc, codes);
      k_avx2::store_halves_avx2<R, H>(acc, r0, t * 16 + 8 * h0, residual, y, n);
    });
  }
}
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")

// R rows x T column tiles a pass (as the Q4 kernel's passes): each slice of codes serves R
// rows, each broadcast of four activation bytes T tiles. With few accumulators a group's
// VPDPBUSD go into two chains (their sum is the same integer), so that their latency hides.
// `ahead`: the next tiles' weights, which the passes after a tile's first ask for,
// `ahead_lines` cache lines a group (null: the first pass, which asks for its own stream
// Q8_PREFETCH bytes ahead).
static inline __m512 scales16(const uint8_t* at, bool half) {
  return half ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)))
              : _mm512_loadu_ps(reinterpret_cast<const float*>(at));
}

template <int R, int T, int G, bool MIN, bool HALF>
static void tiles_vnni(const Acts& a, int64_t r0, const uint8_t* tile, int64_t tile_bytes,
                       const uint8_t* ahead, int64_t ahead_lines, __m512 (&acc)[R][T]) {
  constexpr int64_t B = block_bytes(G, MIN, HALF), S = HALF ? 32 : 64;
  constexpr int CH = R * T < 4 ? 2 : 1;
  const int64_t groups = a.k / G, agroups = a.k / 32;
  for (int r = 0; r < R; r++)
    for (int t = 0; t < T; t++) acc[r][t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; g++) {
    if (ahead) {
      for (int64_t line = 0; line < ahead_lines; line++)
        _mm_prefetch(reinterpret_cast<const char*>(ahead + (g * ahead_lines + line) * 64), _MM_HINT_T0);
    } else {
      for (int t = 0; t < T; t++)
        for (int64_t line = 0; line < B; line += 64)
          _mm_prefetch(reinterpret_cast<const char*>(tile + t * tile_bytes + g * B + Q8_PREFETCH + line),
                       _MM_HINT_T0);
    }
    __m512i sum[CH][R][T];
    for (int r = 0; r < R; r++)
      for (int t = 0; t < T; t++) {
        sum[0][r][t] = _mm512_set1_epi32(a.bias[(r0 + r) * groups + g]);
        for (int ch = 1; ch < CH; ch++) sum[ch][r][t] = _mm512_setzero_si512();
      }
    for (int j = 0; j < G / 4; j++) {
      __m512i w[T];
      for (int t = 0; t < T; t++) w[t] = _mm512_loadu_si512(tile + t * tile_bytes + g * B + 64 * j);
      for (int r = 0; r < R; r++) {
        int32_t four;
        std::memcpy(&four, a.xq + (r0 + r) * a.k + g * G + 4 * j, 4);
        const __m512i xb = _mm512_set1_epi32(four);
        for (int t = 0; t < T; t++) sum[j % CH][r][t] = _mm512_dpbusd_epi32(sum[j % CH][r][t], w[t], xb);
      }
    }
    for (int t = 0; t < T; t++) {
      const uint8_t* blk = tile + t * tile_bytes + g * B;
      const __m512 scale = scales16(blk + 16 * G, HALF);
      for (int r = 0; r < R; r++) {
        __m512i isum = sum[0][r][t];
        for (int ch = 1; ch < CH; ch++) isum = _mm512_add_epi32(isum, sum[ch][r][t]);
        const __m512 sd = _mm512_mul_ps(scale, _mm512_set1_ps(a.dx[(r0 + r) * agroups + g * G / 32]));
        acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), sd, acc[r][t]);
      }
      if (MIN) {
        const __m512 mn = scales16(blk + 16 * G + S, HALF);
        for (int r = 0; r < R; r++)
          acc[r][t] = _mm512_fmadd_ps(mn, _mm512_set1_ps(a.sx[(r0 + r) * groups + g]), acc[r][t]);
      }
    }
  }
}

// rows in passes of P over T column tiles; `next`: the tiles this thread reads after these
// (null if none), whose weights the passes after the first ask for, spread over their groups;
// `next_bytes`: how many bytes of them (default: T tiles of this layout)
template <int T, int G, bool MIN, bool HALF, int P = 4>
static void rows_vnni(const Acts& a, int64_t m, const uint8_t* tile, const uint8_t* next,
                      int64_t t, const float* residual, float* y, int64_t n, int64_t next_bytes = 0) {
  const int64_t groups = a.k / G, tile_bytes = groups * block_bytes(G, MIN, HALF);
  const int64_t lines = (next_bytes > 0 ? next_bytes : T * tile_bytes) / 64;
  k_avx512::row_passes<P>(m, next, lines, groups, [&](auto rows, int64_t r0, Ahead ahead) {
    constexpr int R = decltype(rows)::value;
    __m512 acc[R][T];
    tiles_vnni<R, T, G, MIN, HALF>(a, r0, tile, tile_bytes, ahead.at, ahead.lines, acc);
    k_avx512::store_tiles<R, T>(acc, R, r0, t, n, residual, y);
  });
}

template <int G, bool MIN, bool HALF>
static void columns_vnni(const Acts& a, int64_t m, const uint8_t* packed, const float* residual,
                         float* y, int64_t n, int64_t t0, int64_t t1) {
  const int64_t tile_bytes = a.k / G * block_bytes(G, MIN, HALF);
  int64_t t = t0;
  // two tiles a pass where rows are many enough to be bound by arithmetic, one stream of
  // weights where few rows leave it bound by memory (as the Q4 kernel)
  for (; m > VNNI_ONE_PASS_ROWS && t + 2 <= t1; t += 2)
    rows_vnni<2, G, MIN, HALF>(a, m, packed + t * tile_bytes,
                               t + 4 <= t1 ? packed + (t + 2) * tile_bytes : nullptr, t, residual, y, n);
  for (; t < t1; t++)
    rows_vnni<1, G, MIN, HALF, VNNI_ONE_PASS_ROWS>(
        a, m, packed + t * tile_bytes, t + 2 <= t1 ? packed + (t + 1) * tile_bytes : nullptr, t,
        residual, y, n);
}
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c,amx-tile,amx-int8")

// The same numbers on the AMX tiles (as the Q4 kernel's, amx.h), for groups of 32: a group's
// block of codes is already a weight tile (8 rows of 64 bytes: 16 columns x 4 inputs a row),
// so one TDPBSUD of an activation tile (rows x 32 signed bytes) by it gives each row's 16 sums
// of (code + 128) xq; with the group's bias added they are tiles_vnni's exact integers, folded
// by tiles_vnni's float operations in its order. No unpacking: the weights are read where they
// lie, each group asked for Q8_PREFETCH bytes ahead. (AMX_GROUP: amx.h's group multiply.)

// R rows of one column tile, the tiles configured once a call (k_amx::configure_tiles: a last
// block of fewer rows multiplies the call's zero padding and folds its own rows); each group's
// sums are folded while the next group multiplies
template <int R, bool MIN, bool HALF>
static void tiles_amx(const Acts& a, int64_t r0, const uint8_t* tile, __m512 (&out)[R][1]) {
  constexpr int64_t B = block_bytes(32, MIN, HALF), S = HALF ? 32 : 64;
  const int64_t groups = a.k / 32;
  const int8_t* x = a.xq + r0 * a.k;
  alignas(64) int32_t sums[2][16 * 16];
  __m512 acc[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
  auto fold = [&](const int32_t* group_sums, int64_t g) {
    const uint8_t* blk = tile + g * B;
    const __m512 scale = scales16(blk + 16 * 32, HALF);
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) {
      const __m512i isum = _mm512_add_epi32(_mm512_load_si512(group_sums + 16 * r),
                                            _mm512_set1_epi32(a.bias[(r0 + r) * groups + g]));
      const __m512 sd = _mm512_mul_ps(scale, _mm512_set1_ps(a.dx[(r0 + r) * groups + g]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), sd, acc[r]);
    }
    if (MIN) {
      const __m512 mn = scales16(blk + 16 * 32 + S, HALF);
#pragma GCC unroll 16
      for (int r = 0; r < R; r++)
        acc[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(a.sx[(r0 + r) * groups + g]), acc[r]);
    }
  };
  auto weights = [&](int64_t g) {
    const uint8_t* blk = tile + g * B;
    for (int64_t line = 0; line < B; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(blk + Q8_PREFETCH + line), _MM_HINT_T0);
    return blk;
  };
  int64_t g = 0;
  for (; g + 2 <= groups; g += 2) {
    AMX_GROUP(0, 2, 4, x + g * 32, weights(g), a.k, sums[0]);
    if (g > 0) fold(sums[1], g - 1);
    AMX_GROUP(1, 3, 5, x + (g + 1) * 32, weights(g + 1), a.k, sums[1]);
    fold(sums[0], g);
  }
  if (g < groups) {  // an odd group count: the last group alone
    AMX_GROUP(0, 2, 4, x + g * 32, weights(g), a.k, sums[0]);
    if (g > 0) fold(sums[1], g - 1);
    fold(sums[0], g);
  } else {
    fold(sums[1], groups - 1);
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; r++) out[r][0] = acc[r];
}
#undef AMX_GROUP  // (amx.h's)

// columns_vnni's contract on the tiles: column tiles t0..t1 of y for all m rows, in blocks of
// 16 rows (the last block the rest; a.xq holds whole blocks of 16 rows)
template <bool MIN, bool HALF>
static void columns_amx(const Acts& a, int64_t m, const uint8_t* packed, const float* residual,
                        float* y, int64_t n, int64_t t0, int64_t t1) {
  const int64_t tile_bytes = a.k / 32 * block_bytes(32, MIN, HALF), full = m / 16 * 16;
  k_amx::configure_tiles(m);
  auto block = [&](int rows, int64_t r0, int64_t t) {
    const uint8_t* tile = packed + t * tile_bytes;
#define Q8_AMX_ROWS_CASE(R)                                         \
  case R: {                                                         \
    __m512 acc[R][1];                                               \
    tiles_amx<R, MIN, HALF>(a, r0, tile, acc);                      \
    k_avx512::store_tiles<R, 1>(acc, R, r0, t, n, residual, y);     \
    break;                                                          \
  }
    switch (rows) { EVERY_TILE_ROW_COUNT(Q8_AMX_ROWS_CASE) }
#undef Q8_AMX_ROWS_CASE
  };
  for (int64_t t = t0; t < t1; t++) {
    for (int64_t r0 = 0; r0 < full; r0 += 16) block(16, r0, t);
    if (m > full) block((int)(m - full), full, t);
  }
  _tile_release();  // the tile state back to its initial (small) form for context switches
}
#pragma GCC pop_options

template <int G, bool MIN, bool HALF>
static void columns(int64_t isa, const Acts& a, int64_t m, const uint8_t* packed,
                    const float* residual, float* y, int64_t n, int64_t t0, int64_t t1) {
  if (isa >= AVX512) columns_vnni<G, MIN, HALF>(a, m, packed, residual, y, n, t0, t1);
  else if (isa == AVX2) columns_avx2<G, MIN, HALF>(a, m, packed, residual, y, n, t0, t1);
  else columns_generic<G, MIN, HALF>(a, m, packed, residual, y, n, t0, t1);
}

}  // namespace q8blocks

// y [m, n] = x [m, k'] times block int8 weights packed [N / 16, K / G, B] (+ residual [m, n]);
// k' may fall short of K by less than 32 (inputs padded with zero weights: they are read as 0).
// `half`: float16 scales (and minimums), with groups of 32 only
at::Tensor q8_linear(const at::Tensor& x_in, const at::Tensor& packed, int64_t group,
                     bool minimum, bool half, const c10::optional<at::Tensor>& residual,
                     int64_t n, int64_t isa) {
  TORCH_CHECK(group == 32 || (group == 16 && !half),
              "block int8 groups are 16 (float32 scales) or 32 inputs, not ", group);
  const int64_t bytes = q8blocks::block_bytes(group, minimum, half);
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == bytes && packed.scalar_type() == at::kByte &&
              packed.is_contiguous(), "block int8 weights (group ", group, minimum ? ", minimums" : "",
              half ? ", float16 scales" : "", ") must be packed uint8 [N / 16, K / ", group, ", ",
              bytes, "], got ", packed.sizes());
  const int64_t tiles = packed.size(0), k = packed.size(1) * group, groups = packed.size(1);
  TORCH_CHECK(k % 32 == 0, "packed block int8 inputs must be a multiple of 32, got ", k);
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.is_contiguous() &&
              x_in.size(1) <= k && x_in.size(1) > k - 32,
              "block int8 input: expected a contiguous float32 [rows, ", k, "] tensor, got ",
              x_in.sizes(), " (", x_in.scalar_type(), ")");
  TORCH_CHECK(tiles * 16 >= n && tiles * 16 < n + 16, "packed weights hold ", tiles * 16,
              " columns, not ", n);
  const at::Tensor x = x_in.size(1) == k ? x_in : at::constant_pad_nd(x_in, {0, k - x_in.size(1)});
  const int64_t m = x.size(0);
  const float* res = residual_ptr(residual, m, n);
  const bool amx = group == 32 && tiles_pay(m, isa, Q8_AMX_MIN_ROWS);
  // the tiles read whole blocks of 16 rows of activations (the padding is never folded)
  std::vector<int8_t> xq((amx ? (m + 15) / 16 * 16 : m) * k);
  std::vector<float> dx(m * (k / 32)), sx32(m * (k / 32)), sx(m * groups);
  std::vector<int32_t> bias(m * groups);
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, m, 8, [&](int64_t r0, int64_t r1) {  // rows: one quantisation each
    quantise_rows_isa(xp, r0, r1, k, xq.data(), dx.data(), sx32.data(), isa);
    for (int64_t r = r0; r < r1; r++)
      for (int64_t g = 0; g < groups; g++) {
        int32_t total = 0;
        for (int64_t i = 0; i < group; i++) total += xq[r * k + g * group + i];
        bias[r * groups + g] = -128 * total;
        sx[r * groups + g] = dx[r * (k / 32) + g * group / 32] * (float)total;
      }
  });
  const q8blocks::Acts acts{xq.data(), dx.data(), bias.data(), sx.data(), k};
  auto y = at::empty({m, n}, x.options());
  float* yp = y.data_ptr<float>();
  const uint8_t* w = packed.data_ptr<uint8_t>();
  at::parallel_for(0, tiles, tile_grain(tiles), [&](int64_t t0, int64_t t1) {
    if (amx && minimum && half) q8blocks::columns_amx<true, true>(acts, m, w, res, yp, n, t0, t1);
    else if (amx && minimum) q8blocks::columns_amx<true, false>(acts, m, w, res, yp, n, t0, t1);
    else if (amx && half) q8blocks::columns_amx<false, true>(acts, m, w, res, yp, n, t0, t1);
    else if (amx) q8blocks::columns_amx<false, false>(acts, m, w, res, yp, n, t0, t1);
    else if (group == 16 && minimum) q8blocks::columns<16, true, false>(isa, acts, m, w, res, yp, n, t0, t1);
    else if (group == 16) q8blocks::columns<16, false, false>(isa, acts, m, w, res, yp, n, t0, t1);
    else if (minimum && half) q8blocks::columns<32, true, true>(isa, acts, m, w, res, yp, n, t0, t1);
    else if (minimum) q8blocks::columns<32, true, false>(isa, acts, m, w, res, yp, n, t0, t1);
    else if (half) q8blocks::columns<32, false, true>(isa, acts, m, w, res, yp, n, t0, t1);
    else q8blocks::columns<32, false, false>(isa, acts, m, w, res, yp, n, t0, t1);
  });
  return y;
}
