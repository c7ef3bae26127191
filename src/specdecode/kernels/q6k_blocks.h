// GGUF Q6_K weights in their own 6.6 bits a weight (models/q6k.py): w = d * sc * code, codes
// -32..31, an 8-bit signed sc per 16 inputs, a float16 d per 256 (one super-block).
// Included once by cpu_kernels.cpp, after q8_blocks.h, whose activation quantisers it uses.
//
// The numbers are block int8's for Q6_K (q8_blocks.h with groups of 16, float32 scales d * sc,
// no minimum), in 0.83 bytes a weight instead of 1.25: per row, column and group of 16 the
// integer dot product sum(code * xq) is exact, and it is folded in group order by
//   acc = fma((float)isum, (d * sc) * dx, acc)
// where d * sc, a float16 times an 8-bit integer, is exact in float32, the very scale block
// int8 holds. So a row gets block int8's bits, in a call of any size and position, on every
// instruction set (tested). Only the weights' bytes differ, and with them the memory traffic
// of a decode step.
//
// Packed weights (kernels.pack_q6k), uint8 [N / 16, K / 256, Q6K_BLOCK]: per 16-column tile
// and super-block, 16 groups of 16 inputs, each 192 bytes: slices j = 0..3 (inputs 4j..4j+3)
// as VPDPBUSD reads them (byte 4c + i: input 4j + i of column c) of u = code + 32 in 0..63,
// their low four bits as nibbles (slices 0 and 1 in the low and high nibbles of the first 64
// bytes, slices 2 and 3 of the next 64), their top two bits in the last 64 (slice j's at bits
// 2j); then the 16 groups' sc (16 x 16 bytes, column within group), then the 16 columns' d
// (float16), then padding to a whole number of cache lines.
//
// The integer sums start at -32 times the group's activation sum, so that VPDPBUSD (unsigned
// u times signed xq) gives sum(code * xq).

#define Q6K_GROUP_BYTES 192
#define Q6K_SC_AT (16 * Q6K_GROUP_BYTES)
#define Q6K_D_AT (Q6K_SC_AT + 256)
#define Q6K_BLOCK (Q6K_D_AT + 64)  // 53 cache lines
// how far ahead of the group in use the first row pass asks for a tile's weights
#define Q6K_PREFETCH 4096
// the fewest rows for which tiles are decoded once to block int8's layout
#ifndef Q6K_DECODE_MIN_ROWS
#define Q6K_DECODE_MIN_ROWS 13
#endif

namespace q6k {

// a call's activations: quantised per row and per 32 inputs (quantise_rows), and each group of
// 16's offset -32 * sum(xq)
struct Acts {
  const int8_t* xq;     // [m, k]
  const float* dx;      // [m, k / 32]
  const int32_t* bias;  // [m, k / 16]
  int64_t k;
};

// code + 32 of input i (0..15) of column c in group g of a packed super-block
static inline int32_t unpacked(const uint8_t* super, int g, int c, int i) {
  const uint8_t* grp = super + g * Q6K_GROUP_BYTES;
  const int j = i / 4, at = 4 * c + i % 4;
  const int low = (grp[64 * (j / 2) + at] >> (4 * (j % 2))) & 15;
  const int high = (grp[128 + at] >> (2 * j)) & 3;
  return low | high << 4;
}

// the portable kernel, compiled as it is and again for AVX2 (the same operations)
static inline __attribute__((always_inline)) void columns_portable(
    const Acts& a, int64_t m, const uint8_t* packed, const float* residual, float* y,
    int64_t n, int64_t t0, int64_t t1) {
  const int64_t supers = a.k / 256, groups = a.k / 16, agroups = a.k / 32;
  for (int64_t t = t0; t < t1; t++) {
    for (int64_t r = 0; r < m; r++) {
      float acc[16] = {};
      for (int64_t s = 0; s < supers; s++) {
        const uint8_t* super = packed + (t * supers + s) * Q6K_BLOCK;
        uint16_t dh[16];
        std::memcpy(dh, super + Q6K_D_AT, 32);
        for (int g = 0; g < 16; g++) {
          const int64_t at = s * 16 + g;
          const int8_t* xg = a.xq + r * a.k + at * 16;
          int32_t isum[16];
          for (int c = 0; c < 16; c++) {
            isum[c] = a.bias[r * groups + at];
            for (int i = 0; i < 16; i++) isum[c] += unpacked(super, g, c, i) * xg[i];
          }
          const int8_t* sc = reinterpret_cast<const int8_t*>(super + Q6K_SC_AT + 16 * g);
          const float gx = a.dx[r * agroups + at / 2];
          for (int c = 0; c < 16; c++) {
            const float scale = k_generic::half_to_float(dh[c]) * (float)sc[c];
            acc[c] = FMA((float)isum[c], scale * gx, acc[c]);
          }
        }
      }
      for (int c = 0; c < 16 && t * 16 + c < n; c++) {
        const int64_t at = r * n + t * 16 + c;
        y[at] = residual ? residual[at] + acc[c] : acc[c];
      }
    }
  }
}

static void columns_generic(const Acts& a, int64_t m, const uint8_t* packed,
                            const float* residual, float* y, int64_t n, int64_t t0, int64_t t1) {
  columns_portable(a, m, packed, residual, y, n, t0, t1);
}

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
static void columns_avx2(const Acts& a, int64_t m, const uint8_t* packed, const float* residual,
                         float* y, int64_t n, int64_t t0, int64_t t1) {
  columns_portable(a, m, packed, residual, y, n, t0, t1);
}
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")

// slice j (0..3) of a packed group as VPDPBUSD's unsigned operand: its nibbles, with its two
// top bits moved to bits 4 and 5 ((nibbles & 15) | top in one ternary-logic operation)
template <int J>
static inline __m512i slice(const uint8_t* grp) {
  const __m512i nibbles = _mm512_loadu_si512(grp + 64 * (J / 2));
  const __m512i low = J % 2 ? _mm512_srli_epi16(nibbles, 4) : nibbles;
  const __m512i tops = _mm512_loadu_si512(grp + 128);
  const __m512i moved = J == 0 ? _mm512_slli_epi16(tops, 4)
                        : J == 1 ? _mm512_slli_epi16(tops, 2)
                        : J == 2 ? tops : _mm512_srli_epi16(tops, 2);
  const __m512i top = _mm512_and_si512(moved, _mm512_set1_epi8(0x30));
  return _mm512_ternarylogic_epi32(low, top, _mm512_set1_epi8(0x0f), 0xEC);  // (A & C) | B
}

// R rows x T column tiles a pass (as q8_blocks.h's tiles_vnni): each unpacked slice serves R
// rows, each broadcast of four activation bytes T tiles; with few accumulators a group's
// VPDPBUSD go into two chains. `ahead`: the next tiles' weights, `ahead_lines` cache lines a
// group, which the passes after a tile's first ask for (null: the first pass, which asks for its
// own stream Q6K_PREFETCH bytes ahead).
template <int R, int T>
static void tiles_vnni(const Acts& a, int64_t r0, const uint8_t* tile, int64_t tile_bytes,
                       const uint8_t* ahead, int64_t ahead_lines, __m512 (&acc)[R][T]) {
  constexpr int CH = R * T < 4 ? 2 : 1;
  const int64_t supers = a.k / 256, groups = a.k / 16, agroups = a.k / 32;
  for (int r = 0; r < R; r++)
    for (int t = 0; t < T; t++) acc[r][t] = _mm512_setzero_ps();
  for (int64_t s = 0; s < supers; s++) {
    __m512 d[T];
    for (int t = 0; t < T; t++)
      d[t] = _mm512_cvtph_ps(_mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(tile + t * tile_bytes + s * Q6K_BLOCK + Q6K_D_AT)));
    for (int g = 0; g < 16; g++) {
      const int64_t at = s * 16 + g;
      if (ahead) {
        for (int64_t line = 0; line < ahead_lines; line++)
          _mm_prefetch(reinterpret_cast<const char*>(ahead + (at * ahead_lines + line) * 64), _MM_HINT_T0);
      } else {  // the super-block's 53 lines spread over its 16 groups
        for (int t = 0; t < T; t++)
          for (int line = 53 * g / 16; line < 53 * (g + 1) / 16; line++)
            _mm_prefetch(reinterpret_cast<const char*>(tile + t * tile_bytes + s * Q6K_BLOCK +
                                                       Q6K_PREFETCH + 64 * line), _MM_HINT_T0);
      }
      __m512i sum[CH][R][T];
      for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) {
          sum[0][r][t] = _mm512_set1_epi32(a.bias[(r0 + r) * groups + at]);
          for (int ch = 1; ch < CH; ch++) sum[ch][r][t] = _mm512_setzero_si512();
        }
      const uint8_t* grp[T];
      for (int t = 0; t < T; t++) grp[t] = tile + t * tile_bytes + s * Q6K_BLOCK + g * Q6K_GROUP_BYTES;
#define Q6K_SLICE(J)                                                                        \
  {                                                                                         \
    __m512i w[T];                                                                           \
    for (int t = 0; t < T; t++) w[t] = slice<J>(grp[t]);                                    \
    for (int r = 0; r < R; r++) {                                                           \
      int32_t four;                                                                         \
      std::memcpy(&four, a.xq + (r0 + r) * a.k + at * 16 + 4 * J, 4);                       \
      const __m512i xb = _mm512_set1_epi32(four);                                           \
      for (int t = 0; t < T; t++) sum[J % CH][r][t] = _mm512_dpbusd_epi32(sum[J % CH][r][t], w[t], xb); \
    }                                                                                       \
  }
      Q6K_SLICE(0) Q6K_SLICE(1) Q6K_SLICE(2) Q6K_SLICE(3)
#undef Q6K_SLICE
      for (int t = 0; t < T; t++) {
        const __m128i sc = _mm_loadu_si128(
            reinterpret_cast<const __m128i*>(tile + t * tile_bytes + s * Q6K_BLOCK + Q6K_SC_AT + 16 * g));
        const __m512 scale = _mm512_mul_ps(d[t], _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)));
        for (int r = 0; r < R; r++) {
          __m512i isum = sum[0][r][t];
          for (int ch = 1; ch < CH; ch++) isum = _mm512_add_epi32(isum, sum[ch][r][t]);
          const __m512 sd = _mm512_mul_ps(scale, _mm512_set1_ps(a.dx[(r0 + r) * agroups + at / 2]));
          acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), sd, acc[r][t]);
        }
      }
    }
  }
}

// rows in passes of 4 over T column tiles; `next`: the tiles this thread reads after these
// (null if none), whose weights the passes after the first ask for, spread over their groups
template <int T>
static void rows_vnni(const Acts& a, int64_t m, const uint8_t* tile, const uint8_t* next,
                      int64_t t, const float* residual, float* y, int64_t n) {
  const int64_t groups = a.k / 16, tile_bytes = a.k / 256 * Q6K_BLOCK, passes = (m + 3) / 4;
  const int64_t lines = T * tile_bytes / 64;
  const int64_t per_group = passes > 1 ? (lines + (passes - 1) * groups - 1) / ((passes - 1) * groups) : 0;
  for (int64_t r0 = 0; r0 < m; r0 += 4) {
    const int64_t first_line = (r0 / 4 - 1) * groups * per_group;
    const uint8_t* ahead = r0 > 0 && next && first_line < lines ? next + first_line * 64 : nullptr;
    const int64_t ahead_lines = ahead ? std::min(per_group, (lines - first_line) / groups) : 0;
#define Q6K_ROWS_CASE(R)                                                    \
  {                                                                         \
    __m512 acc[R][T];                                                       \
    tiles_vnni<R, T>(a, r0, tile, tile_bytes, ahead, ahead_lines, acc);     \
    k_avx512::store_tiles<R, T>(acc, R, r0, t, n, residual, y);             \
  }                                                                         \
  break;
    switch (std::min<int64_t>(4, m - r0)) {
      case 4: Q6K_ROWS_CASE(4)
      case 3: Q6K_ROWS_CASE(3)
      case 2: Q6K_ROWS_CASE(2)
      default: Q6K_ROWS_CASE(1)
    }
#undef Q6K_ROWS_CASE
  }
}

// tile t's codes and scales decoded to block int8's layout for groups of 16 (q8_blocks.h:
// per group 4 slices of unsigned codes, here u = code + 32, then 16 float32 scales d * sc),
// asking for the tile's stream Q6K_PREFETCH bytes ahead
static void decode_tile(const uint8_t* tile, int64_t k, uint8_t* out) {
  for (int64_t s = 0; s < k / 256; s++) {
    const uint8_t* super = tile + s * Q6K_BLOCK;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(super + Q6K_D_AT)));
    for (int g = 0; g < 16; g++) {
      for (int line = 53 * g / 16; line < 53 * (g + 1) / 16; line++)
        _mm_prefetch(reinterpret_cast<const char*>(super + Q6K_PREFETCH + 64 * line), _MM_HINT_T0);
      const uint8_t* grp = super + g * Q6K_GROUP_BYTES;
      uint8_t* blk = out + (s * 16 + g) * q8blocks::block_bytes(16, false, false);
      _mm512_storeu_si512(blk, slice<0>(grp));
      _mm512_storeu_si512(blk + 64, slice<1>(grp));
      _mm512_storeu_si512(blk + 128, slice<2>(grp));
      _mm512_storeu_si512(blk + 192, slice<3>(grp));
      const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(super + Q6K_SC_AT + 16 * g));
      _mm512_storeu_ps(reinterpret_cast<float*>(blk + 256),
                       _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc))));
    }
  }
}

// More rows than one pass holds: each pass would unpack the codes again, so a tile (two, as
// q8_blocks.h pairs them) is decoded once into block int8's layout, in cache, and block int8's
// kernel runs every row over it, its later passes asking for the next tiles' packed weights.
// Its bits are the direct kernel's: the same integers and the same float operations.
static void columns_decoded(const q8blocks::Acts& a, int64_t m, const uint8_t* packed,
                            const float* residual, float* y, int64_t n, int64_t t0, int64_t t1) {
  const int64_t tile_bytes = a.k / 256 * Q6K_BLOCK;
  const int64_t decoded_bytes = a.k / 16 * q8blocks::block_bytes(16, false, false);
  std::vector<uint8_t> decoded(2 * decoded_bytes);
  for (int64_t t = t0; t < t1; t += 2) {
    const int64_t count = std::min<int64_t>(2, t1 - t);
    for (int64_t i = 0; i < count; i++)
      decode_tile(packed + (t + i) * tile_bytes, a.k, decoded.data() + i * decoded_bytes);
    const uint8_t* next = t + count < t1 ? packed + (t + count) * tile_bytes : nullptr;
    const int64_t next_bytes = std::min<int64_t>(2, t1 - t - count) * tile_bytes;
    if (count == 2)
      q8blocks::rows_vnni<2, 16, false, false>(a, m, decoded.data(), next, t, residual, y, n, next_bytes);
    else
      q8blocks::rows_vnni<1, 16, false, false>(a, m, decoded.data(), next, t, residual, y, n, next_bytes);
  }
}

static void columns_vnni(const Acts& a, int64_t m, const uint8_t* packed, const float* residual,
                         float* y, int64_t n, int64_t t0, int64_t t1) {
  const int64_t tile_bytes = a.k / 256 * Q6K_BLOCK;
  int64_t t = t0;
  // two tiles a pass where rows are many enough to be bound by arithmetic, one stream of
  // weights where few rows leave it bound by memory (as the Q4 and block int8 kernels)
  for (; m > 4 && t + 2 <= t1; t += 2)
    rows_vnni<2>(a, m, packed + t * tile_bytes, t + 4 <= t1 ? packed + (t + 2) * tile_bytes : nullptr,
                 t, residual, y, n);
  for (; t < t1; t++)
    rows_vnni<1>(a, m, packed + t * tile_bytes, t + 2 <= t1 ? packed + (t + 1) * tile_bytes : nullptr,
                 t, residual, y, n);
}
#pragma GCC pop_options

}  // namespace q6k

// y [m, n] = x [m, k] times Q6_K weights packed [N / 16, K / 256, Q6K_BLOCK] (+ residual [m, n])
at::Tensor q6k_linear(const at::Tensor& x, const at::Tensor& packed,
                      const c10::optional<at::Tensor>& residual, int64_t n, int64_t isa) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == Q6K_BLOCK && packed.scalar_type() == at::kByte &&
              packed.is_contiguous(), "Q6_K weights must be packed uint8 [N / 16, K / 256, ",
              Q6K_BLOCK, "], got ", packed.sizes());
  const int64_t tiles = packed.size(0), k = packed.size(1) * 256, m = x.size(0);
  check_rows(x, k, "Q6_K linear input");
  TORCH_CHECK(tiles * 16 >= n && tiles * 16 < n + 16, "packed weights hold ", tiles * 16,
              " columns, not ", n);
  const float* res = residual_ptr(residual, m, n);
  // more rows than a pass of the direct kernel: tiles decoded once to block int8's layout
  const bool decoded = isa >= AVX512 && m >= Q6K_DECODE_MIN_ROWS;
  std::vector<int8_t> xq(m * k);
  std::vector<float> dx(m * (k / 32)), sx(m * (k / 32));
  std::vector<int32_t> bias(m * (k / 16));
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, m, 8, [&](int64_t r0, int64_t r1) {  // rows: one quantisation each
    if (isa >= AVX512)
      k_avx512::quantise_rows_avx512(xp, r0, r1, k, xq.data(), dx.data(), sx.data());
    else
      quantise_rows(xp, r0, r1, k, xq.data(), dx.data(), sx.data());
    for (int64_t r = r0; r < r1; r++)
      for (int64_t g = 0; g < k / 16; g++) {
        int32_t total = 0;
        for (int64_t i = 0; i < 16; i++) total += xq[r * k + g * 16 + i];
        bias[r * (k / 16) + g] = -32 * total;
      }
  });
  const q6k::Acts acts{xq.data(), dx.data(), bias.data(), k};
  const q8blocks::Acts acts8{xq.data(), dx.data(), bias.data(), nullptr, k};  // no minimums
  auto y = at::empty({m, n}, x.options());
  float* yp = y.data_ptr<float>();
  const uint8_t* w = packed.data_ptr<uint8_t>();
  at::parallel_for(0, tiles, tile_grain(tiles), [&](int64_t t0, int64_t t1) {
    if (decoded) q6k::columns_decoded(acts8, m, w, res, yp, n, t0, t1);
    else if (isa >= AVX512) q6k::columns_vnni(acts, m, w, res, yp, n, t0, t1);
    else if (isa == AVX2) q6k::columns_avx2(acts, m, w, res, yp, n, t0, t1);
    else q6k::columns_generic(acts, m, w, res, yp, n, t0, t1);
  });
  return y;
}
