// Weights of 2 to 6-bit codes in the bytes of the file's own blocks (models/int8_blocks.py), not
// widened to bytes.
// Included once by cpu_kernels.cpp, after q8_blocks.h, whose activation quantisers and kernel
// it uses.
//
// The layouts:
// - FIVE_BIT: block int8 in groups of 32 with float16 scales (and minimums) whose codes fit in 5
//   bits (-16..15 without minimums, 0..31 with): GGUF Q5_0, Q5_1 and MXFP4, in 0.69 (0.75) bytes
//   a weight instead of 1.06 (1.13). Block int8's numbers: per row, column and group the exact
//   integer isum = sum(code * xq) is folded in group order as block int8 folds it,
//     acc = fma((float)isum, scale * dx, acc)   (acc = fma(minimum, dx * sum(xq), acc)),
//   activations quantised per 32 inputs; a row gets block int8's bits.
// - Q6K: a GGUF Q6_K matrix, w = d * sc * code, codes -32..31, an 8-bit sc per 16 inputs and a
//   float16 d per super-block of 256, in 0.83 bytes a weight. Its sub-block scales are integers,
//   so they are folded in integers, as llama.cpp folds Q6_K against its Q8_K activations:
//   activations quantised per row and per 256 inputs (dx), and per super-block
//     S = sum over its 16 sub-blocks of sc * isum   (exact: |S| < 2^28)
//     acc = fma((float)S, d * dx, acc)
//   one float fold per 256 inputs instead of 16. On AMX the sub-block scales go into the weight
//   tiles (v = sc * code, -4064..4096, split into bytes v = 256 hi + lo), so the tiles sum a whole
//   super-block and only S is folded (q6k_columns_amx below).
// - Q3K: GGUF Q3_K in Q6K's form (codes -4..3, sc - 32 per 16 inputs, d per 256) with u = code
//   + 8 in the nibbles only (TOP = 0): B = 2368, 0.58 bytes a weight against Q6K's 0.83, Q6K's
//   numbers (on AMX CPUs the loader keeps Q6K's layout, whose tiles take many rows).
// - Q2K: GGUF Q2_K (codes 0..3, 4-bit sc and m per 16 inputs, d and dmin per 256), its codes in
//   2 bits and its minimums folded in integers as its scales (the Q2K struct below).
// - Q4K: GGUF Q4_K (codes 0..15, 6-bit sc and m per 32 inputs, d and dmin per 256) in Q2K's
//   form: 0.58 bytes a weight (the file's 0.56, whose sc and m take 6 bits each), sub-block
//   scales and minimums folded in integers (on AMX CPUs the loader keeps int4's Q4_1 blocks,
//   whose tiles take many rows; on AVX2 alone too, whose Q4 kernel is faster from 4 rows).
// - Q5K: GGUF Q5_K (codes 0..31) in Q4K's form with the fifth bits (TOP = 1): 0.70 bytes a
//   weight (the loader holds it where it holds Q4K; elsewhere FIVE_BIT32 or block int8).
// - IQ4XS: GGUF IQ4_XS (codes from kvalues_iq4nl, a 6-bit ls per 32 inputs, sc = ls - 32, and a
//   float16 d per 256) in Q4K's form without minimums, its codes as a codebook's indices, its
//   sub-block scales folded in integers as Q6K's: 0.55 bytes a weight against CODEBOOK32's 0.63
//   (the file's 0.53; the loader holds it where it holds Q4K, elsewhere as CODEBOOK32 or block
//   int8, whose activations are quantised per 32 inputs, so their bits differ from IQ4XS's).
// Integer sums are exact in any order and the float operations depend on K alone, so a row's
// output is the same in a call of any size and position, on every instruction set (tested).
//
// Packed weights (kernels.pack_q6k, kernels.pack_five_bit), uint8 [N / 16, K / (G x GROUPS), B]:
// per 16-column tile and block of GROUPS groups of G inputs, each group's u = code + offset
// (unsigned) in G / 4 slices of VPDPBUSD's operand order (byte 4c + i of slice j: input 4j + i
// of column c), stored as their low four bits, slices 2i and 2i + 1 in the low and high nibbles
// of 64 bytes, then their top bits in 64 more (slice j's at bits TOP j); then the block's scales:
// - Q6K: GROUPS = 16 of G = 16, TOP = 2: 16 x 192 bytes, the groups' sc (16 x 16 bytes, group
//   major), the columns' d (float16), 32 bytes of padding: B = 3392, 53 cache lines;
// - FIVE_BIT: GROUPS = 1 of G = 32, TOP = 1: 320 bytes, the columns' scales (float16), their
//   minimums (float16) if any: B = 352 or 384;
// - FIVE_BIT32: FIVE_BIT with float32 scales and minimums (GGUF Q5_K: d * sc and dmin * m have
//   up to 17 significant bits): B = 384 or 448, 0.875 bytes a weight against block int8's 1.25,
//   block int8's numbers (on AMX CPUs the loader keeps block int8, whose tiles take many rows).
// - CODEBOOK, CODEBOOK32: codes from a table of sixteen int8 values that each call passes (GGUF
//   IQ4_NL's and IQ4_XS's kvalues_iq4nl, -127..113; IQ3_XXS's and IQ2_XXS's grid values),
//   stored as their 4-bit index, TOP = 0 (no top bits), with float16 scales (IQ4_NL) or float32
//   ones (IQ4_XS's d * (ls - 32), IQ3_XXS's, IQ2_XXS's): B = 288 or 320, 0.56 or 0.63 bytes a
//   weight against block int8's 1.06 or 1.13, and block int8's numbers: the index looked up
//   with VPSHUFB, on AVX2 then block int8's AVX2 arithmetic on the signed codes, on AVX-512 the
//   code + 128 as VPDPBUSD's unsigned operand (offset 128). CODEBOOK16: G = 16 with float32
//   scales (IQ2_XS, IQ2_S: a scale per 16 inputs): B = 192, 0.75 bytes a weight against block
//   int8's 1.25. (On AMX CPUs the loader keeps IQ4_NL and IQ4_XS as block int8, as FIVE_BIT32.)
// The integer sums start at -offset times the group's activation sum, so that VPDPBUSD
// (unsigned u times signed xq) gives sum(code * xq).

// how far ahead of the group in use the first row pass asks for a tile's weights (on a Zen 5,
// the 1.5B's one-row forwards with 8192 took 0.92x, then 1.02-1.03x the time of 4096 in runs an
// hour apart: the best distance moves with the machine's memory latency)
#define SMALL_CODES_PREFETCH 4096
// the fewest rows for which a FIVE_BIT tile is decoded once to block int8's layout on AVX-512
// (measured on a Zen 5: scripts/small_codes_layouts.py; each pass of 4 rows unpacks below it).
// The other layouts' VNNI passes unpack a slice for each pass of 4 rows below
// SUPER_DECODE_MIN_ROWS: on a Zen 4 whole decoded tiles took 1.05-1.22x their time at 16-32
// rows, 0.98-1.05x at 64 (Q5_K, IQ4_XS), on a Zen 5 1.05-1.19x at 12-64 rows (Q4_K, Q6_K)
#ifndef SMALL_CODES_DECODE_MIN_ROWS
#define SMALL_CODES_DECODE_MIN_ROWS 13
#endif
// the fewest rows for which the super-block layouts' VNNI passes read each super-block of a
// tile pair decoded once (columns_vnni_decoded). The 1.5B's Q4_K and Q6_K forwards after 256
// positions on a Zen 5, 2 threads, against the direct passes (scripts/kernels_ab.py): 48 rows
// 1.04x the time, 64 0.99x, 80 0.95-0.99x, 96 0.92x, 128 0.91x, 256 0.87-0.89x, prompts of
// 512 to 2048 tokens 0.90-0.96x. (Q6_K alone decoded so from 9 rows, whose unpacking costs 13
// operations for 4 slices against Q4_K's 6: 12 rows 1.05x, 16 rows 1.03x, 32-64 rows 0.99x.)
#ifndef SUPER_DECODE_MIN_ROWS
#define SUPER_DECODE_MIN_ROWS 72
#endif
// a decoded super-block's bytes: 256 inputs of 16 columns, a byte each
constexpr int64_t DECODED_BLOCK_BYTES = 4096;
// the fewest rows for which Q6K on AVX2 decodes each column tile once (decode_q6k_avx2)
// instead of every pass of 4 rows unpacking the codes again (measured on the 1.5B's Q6_K
// matrices, 2 threads, against the passes: 4 rows 1.28x the time, 5 rows 0.96x, 16 rows 0.84x,
// 64 rows 0.72x)
#ifndef Q6K_AVX2_DECODE_MIN_ROWS
#define Q6K_AVX2_DECODE_MIN_ROWS 5
#endif
// the same for Q3K, and for Q2K (whose direct passes of 4 rows beat the decoded tiles, 0.72x,
// and from 5 to 16 rows are level with them: 0.92-1.08x, run to run)
#ifndef Q3K_AVX2_DECODE_MIN_ROWS
#define Q3K_AVX2_DECODE_MIN_ROWS 4
#endif
#ifndef Q2K_AVX2_DECODE_MIN_ROWS
#define Q2K_AVX2_DECODE_MIN_ROWS 5
#endif
// the fewest rows for which Q6K takes the AMX tiles (where the CPU has them): each call decodes
// its weights into tiles, which fewer rows do not repay (measured on the 1.5B's Q6_K downs and
// head, 2 threads: AMX / VNNI 1.3x at 8 rows, 1.06-1.23x at 12, 0.89-1.0x at 16, 0.45-0.58x at
// 64)
#ifndef Q6K_AMX_MIN_ROWS
#define Q6K_AMX_MIN_ROWS 14
#endif

namespace small_codes {

// column c's float16 number at `at`
static inline float half_at(const uint8_t* at, int c) {
  uint16_t h;
  std::memcpy(&h, at + 2 * c, 2);
  return k_generic::half_to_float(h);
}

// SUPER: Q6K's and Q3K's sub-block scales folded in integers per super-block of 256 inputs;
// FIVE_BIT computes block int8's numbers. CODEBOOK: the packed 4 bits are an index into the
// call's codebook, sixteen int8 codes (signed, no offset). TOP_BITS: 2 (Q6K: codes -32..31,
// offset 32) or 0 (Q3K: codes -8..7, offset 8).
template <int TOP_BITS>
struct SuperScales {
  static constexpr int G = 16, TOP = TOP_BITS, GROUPS = 16, OFFSET = TOP ? 32 : 8, CODE_BITS = 4;
  static constexpr bool SUPER = true, FLOAT32 = false, CODEBOOK = false, SUB_MINS = false,
                        PACKED_MINS = false;
  static constexpr int GROUP_BYTES = 8 * G + 32 * TOP, SC_AT = GROUPS * GROUP_BYTES, D_AT = SC_AT + 256;
  static constexpr int64_t block_bytes(bool) { return D_AT + 64; }
  // column c's sc of group g, and its d
  static inline int32_t sub_scale(const uint8_t* block, int g, int c) {
    return reinterpret_cast<const int8_t*>(block + SC_AT)[16 * g + c];
  }
  static inline float super_scale(const uint8_t* block, int c) { return half_at(block + D_AT, c); }
};
using Q6K = SuperScales<2>;
using Q3K = SuperScales<0>;

// Q2K: GGUF Q2_K, w = d * sc * code - dmin * m, codes 0..3, a 4-bit sc and m per 16 inputs (one
// byte, sc in its low nibble, as the file holds them), float16 d and dmin per 256. Groups of 64
// bytes (byte 4c + i holds input 4j + i of column c at bits 2j, j = 0..3), the groups' sc | m
// << 4 (16 x 16 bytes, group major), the columns' d, their dmin: B = 1344, the file's 0.33
// bytes a weight. Q6K's integer fold of sc, and its minimums folded likewise, per super-block
//   S = sum of sc * isum, M = sum of m * sum(xq)   (exact: |S| < 2^21, |M| < 2^19)
//   acc = fma((float)S, d * dx, acc), acc = fma(-(float)M, dmin * dx, acc)
// (PACKED_MINS: sc and m share a byte; MIN_AT: where the groups' m are, as their sc at SC_AT)
struct Q2K {
  static constexpr int G = 16, TOP = 0, GROUPS = 16, OFFSET = 0, CODE_BITS = 2;
  static constexpr bool SUPER = true, FLOAT32 = false, CODEBOOK = false, SUB_MINS = true,
                        PACKED_MINS = true;
  static constexpr int GROUP_BYTES = 64, SC_AT = GROUPS * GROUP_BYTES, MIN_AT = SC_AT,
                       D_AT = SC_AT + 256, DMIN_AT = D_AT + 32;
  static constexpr int64_t block_bytes(bool) { return DMIN_AT + 32; }
  static inline int32_t sub_scale(const uint8_t* block, int g, int c) { return block[SC_AT + 16 * g + c] & 15; }
  static inline int32_t sub_min(const uint8_t* block, int g, int c) { return block[SC_AT + 16 * g + c] >> 4; }
  static inline float super_scale(const uint8_t* block, int c) { return half_at(block + D_AT, c); }
  static inline float super_min(const uint8_t* block, int c) { return half_at(block + DMIN_AT, c); }
};

// Q4K: GGUF Q4_K, w = d * sc * code - dmin * m, codes 0..15, a 6-bit sc and m per 32 inputs,
// float16 d and dmin per 256. Groups of 256 bytes (the codebook layouts' nibbles: slices 2i
// and 2i + 1 in the low and high nibbles of 64 bytes), the groups' sc (8 x 16 bytes, group
// major), their m in pairs of groups (4 x 32 bytes: column c's m of groups 2p and 2p + 1 at
// bytes 2c and 2c + 1 of pair p, which widen to the 16-bit pairs of the minimums' fold), the
// columns' d, their dmin: B = 2368, 0.58 bytes a weight against int4's 0.625 (the file's 0.56,
// whose sc and m take 6 bits each). Q2K's folds (exact: |S| < 2^25, |M| < 2^22), one a
// super-block where int4's Q4_1 blocks fold twice per 32 inputs. Q5K (TOP_BITS 1, GGUF Q5_K):
// each group's fifth bits after its nibbles, as FIVE_BIT's (64 bytes, slice j's at bit j): B =
// 2880, 0.70 bytes a weight against FIVE_BIT32's 0.875 (|S| < 2^26)
template <int TOP_BITS>
struct SubMins32 {
  static constexpr int G = 32, TOP = TOP_BITS, GROUPS = 8, OFFSET = 0, CODE_BITS = 4;
  static constexpr bool SUPER = true, FLOAT32 = false, CODEBOOK = false, SUB_MINS = true,
                        PACKED_MINS = false;
  static constexpr int GROUP_BYTES = 8 * G + 2 * TOP * G, SC_AT = GROUPS * GROUP_BYTES,
                       MIN_AT = SC_AT + 16 * GROUPS, D_AT = MIN_AT + 16 * GROUPS, DMIN_AT = D_AT + 32;
  static constexpr int64_t block_bytes(bool) { return DMIN_AT + 32; }
  static inline int32_t sub_scale(const uint8_t* block, int g, int c) { return block[SC_AT + 16 * g + c]; }
  static inline int32_t sub_min(const uint8_t* block, int g, int c) {
    return block[MIN_AT + 32 * (g / 2) + 2 * c + g % 2];
  }
  static inline float super_scale(const uint8_t* block, int c) { return half_at(block + D_AT, c); }
  static inline float super_min(const uint8_t* block, int c) { return half_at(block + DMIN_AT, c); }
};
using Q4K = SubMins32<0>;
using Q5K = SubMins32<1>;

// IQ4XS: GGUF IQ4_XS, w = d * sc * kvalues_iq4nl[index], sc = ls - 32 (-32..31) per 32 inputs, d
// float16 per 256. Groups of 256 bytes of the indices' nibbles (Q4K's), the groups' sc (8 x 16
// bytes, group major, int8), the columns' d, 32 bytes of zeros (a whole number of cache lines):
// B = 2240, 0.55 bytes a weight. Q6K's fold (exact: |isum| <= 32 x 127 x 127 < 2^19, |S| < 2^27)
struct IQ4XS {
  static constexpr int G = 32, TOP = 0, GROUPS = 8, OFFSET = 0, CODE_BITS = 4;
  static constexpr bool SUPER = true, FLOAT32 = false, CODEBOOK = true, SUB_MINS = false,
                        PACKED_MINS = false;
  static constexpr int GROUP_BYTES = 8 * G, SC_AT = GROUPS * GROUP_BYTES, D_AT = SC_AT + 16 * GROUPS;
  static constexpr int64_t block_bytes(bool) { return D_AT + 64; }
  static inline int32_t sub_scale(const uint8_t* block, int g, int c) {
    return reinterpret_cast<const int8_t*>(block + SC_AT)[16 * g + c];
  }
  static inline float super_scale(const uint8_t* block, int c) { return half_at(block + D_AT, c); }
};

// column c's float32 number at `at`
static inline float float_at(const uint8_t* at, int c) {
  float f;
  std::memcpy(&f, at + 4 * c, 4);
  return f;
}

// F32: the scales and minimums as float32 (FIVE_BIT32: Q5_K's d * sc and dmin * m, which are
// not float16 numbers), else float16
// TOP bits of each code above its nibble (1: five-bit codes; 0: a codebook's indices), a scale
// per GROUP inputs (16: CODEBOOK16 alone)
template <bool F32, int TOP_BITS = 1, int GROUP = 32>
struct FiveBitScales {
  static constexpr int G = GROUP, TOP = TOP_BITS, GROUPS = 1, SCALE_BYTES = F32 ? 4 : 2, CODE_BITS = 4;
  static constexpr bool SUPER = false, FLOAT32 = F32, CODEBOOK = TOP == 0, SUB_MINS = false;
  static constexpr int GROUP_BYTES = 8 * G + 8 * TOP * G / 4, SC_AT = GROUP_BYTES,
                       MIN_AT = SC_AT + 16 * SCALE_BYTES;
  static constexpr int64_t block_bytes(bool minimum) {
    return MIN_AT + (minimum ? 16 * SCALE_BYTES : 0);
  }
  static inline float number(const uint8_t* at, int c) {
    return F32 ? float_at(at, c) : half_at(at, c);
  }
  static inline float scale(const uint8_t* block, int, int c) { return number(block + SC_AT, c); }
  static inline float minimum(const uint8_t* block, int, int c) { return number(block + MIN_AT, c); }
};
using FiveBit = FiveBitScales<false>;
using FiveBit32 = FiveBitScales<true>;
using Codebook = FiveBitScales<false, 0>;
using Codebook32 = FiveBitScales<true, 0>;
using Codebook16 = FiveBitScales<true, 0, 16>;

// the code offsets: u = code + offset is what the packed bytes hold
template <class F>
constexpr int32_t offset(bool minimum) {
  if constexpr (F::SUPER) return F::OFFSET;
  else return minimum ? 0 : 16;  // 0..31 with minimums, -16..15 without
}

// a call's activations: quantised per row and per 32 inputs (Q6K: per 256, quantise_rows), with
// each group's offset term -offset * sum(xq) and (for minimums) dx * sum(xq)
struct Acts {
  const int8_t* xq;     // [m, k]
  const float* dx;      // [m, k / 32] (Q6K: [m, k / 256])
  const int32_t* bias;  // [m, k / G] (empty where xu is set)
  const float* sx;      // [m, k / 32]
  int64_t k;
  // Q6K on decoded AVX2 tiles: xq + 128, each pass's rows interleaved by words of 4 inputs
  // (q6k_interleave)
  const uint8_t* xu = nullptr;
  // Q2K, Q4K, Q5K: each group's sum(xq) [m, k / G] (|.| <= 32 x 128), for their minimums
  const int16_t* xsum = nullptr;
  // CODEBOOK layouts: the sixteen codes the weights' 4-bit indices name
  const int8_t* codebook = nullptr;
};

template <class F>
constexpr bool is_q6k = std::is_same_v<F, Q6K>;

// u of input i of column c in a packed group (CODEBOOK: the code its index names)
template <class F>
static inline int32_t unpacked(const uint8_t* grp, int c, int i, const int8_t* codebook) {
  const int j = i / 4, at = 4 * c + i % 4;
  if constexpr (F::CODE_BITS == 2) return (grp[at] >> (2 * j)) & 3;
  const int low = (grp[64 * (j / 2) + at] >> (4 * (j % 2))) & 15;
  if constexpr (F::CODEBOOK) return codebook[low];
  if constexpr (F::TOP == 0) return low;
  const int top = (grp[8 * F::G + at] >> (F::TOP * j)) & ((1 << F::TOP) - 1);
  return low | top << 4;
}

// the portable kernel (baseline x86-64)
template <class F, bool MIN>
static void columns_generic(
    const Acts& a, int64_t m, const uint8_t* packed, const float* residual, float* y,
    int64_t n, int64_t t0, int64_t t1) {
  const int64_t blocks = a.k / (F::G * F::GROUPS), groups = a.k / F::G, agroups = a.k / 32;
  const int64_t bytes = F::block_bytes(MIN);
  for (int64_t t = t0; t < t1; t++) {
    for (int64_t r = 0; r < m; r++) {
      float acc[16] = {};
      for (int64_t b = 0; b < blocks; b++) {
        const uint8_t* block = packed + (t * blocks + b) * bytes;
        int32_t super_sum[16] = {};  // Q6K: S
        for (int g = 0; g < F::GROUPS; g++) {
          const int64_t at = b * F::GROUPS + g;
          const int8_t* xg = a.xq + r * a.k + at * F::G;
          for (int c = 0; c < 16; c++) {
            int32_t isum = F::SUB_MINS ? 0 : a.bias[r * groups + at];  // (no code offset)
            for (int i = 0; i < F::G; i++)
              isum += unpacked<F>(block + g * F::GROUP_BYTES, c, i, a.codebook) * xg[i];
            if constexpr (F::SUPER) {
              super_sum[c] += F::sub_scale(block, g, c) * isum;
            } else {
              const int64_t at32 = r * agroups + at * F::G / 32;  // (the activations' group of 32)
              acc[c] = FMA((float)isum, F::scale(block, g, c) * a.dx[at32], acc[c]);
              if constexpr (MIN) acc[c] = FMA(F::minimum(block, g, c), a.sx[at32], acc[c]);
            }
          }
        }
        if constexpr (F::SUPER)
          for (int c = 0; c < 16; c++)
            acc[c] = FMA((float)super_sum[c], F::super_scale(block, c) * a.dx[r * blocks + b], acc[c]);
        if constexpr (F::SUB_MINS)
          for (int c = 0; c < 16; c++) {
            int32_t min_sum = 0;  // M
            for (int g = 0; g < F::GROUPS; g++)
              min_sum += F::sub_min(block, g, c) * a.xsum[r * groups + b * F::GROUPS + g];
            acc[c] = FMA(-(float)min_sum, F::super_min(block, c) * a.dx[r * blocks + b], acc[c]);
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

// slice j of half h (8 columns) of a packed group as VPMADDUBSW's unsigned operand: its
// nibbles, with its top bits moved to bit 4 and up
template <class F, int J>
static inline __m256i slice_avx2(const uint8_t* grp, int h) {
  if constexpr (F::CODE_BITS == 2) {
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(grp + 32 * h));
    return _mm256_and_si256(_mm256_srli_epi16(bytes, 2 * J), _mm256_set1_epi8(3));
  }
  const __m256i nibbles = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(grp + 64 * (J / 2) + 32 * h));
  const __m256i low = _mm256_and_si256(J % 2 ? _mm256_srli_epi16(nibbles, 4) : nibbles, _mm256_set1_epi8(0x0f));
  if constexpr (F::TOP == 0) return low;
  const __m256i tops = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(grp + 8 * F::G + 32 * h));
  constexpr int shift = 4 - F::TOP * J;  // from bit TOP j to bit 4
  const __m256i moved = shift > 0 ? _mm256_slli_epi16(tops, shift)
                        : shift < 0 ? _mm256_srli_epi16(tops, -shift) : tops;
  return _mm256_or_si256(low, _mm256_and_si256(moved, _mm256_set1_epi8((char)(((1 << F::TOP) - 1) << 4))));
}

// every slice of a group's half, J = 0 .. G / 4 - 1, through `use(J as a type, slice)`
template <class F, int J = 0, class Use>
static inline void each_slice_avx2(const uint8_t* grp, int h, Use&& use) {
  if constexpr (J < F::G / 4) {
    use(std::integral_constant<int, J>{}, slice_avx2<F, J>(grp, h));
    each_slice_avx2<F, J + 1>(grp, h, use);
  }
}

// A codebook layout's codes for block int8's AVX2 kernel (q8blocks::halves_avx2): slice j's
// 4-bit indices (the nibbles of slices 2i and 2i + 1 share 64 bytes) looked up in `codebook`
// with VPSHUFB (which looks up within each 128-bit lane: the table is in both)
struct CodebookCodes {
  const int8_t* codebook;  // sixteen codes
  static constexpr int64_t code_bytes(int group) { return 8 * group; }
  inline __m256i slice(const uint8_t* grp, int j, int h) const {
    const __m256i nibbles = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(grp + 64 * (j / 2) + 32 * h));
    const __m256i index = _mm256_and_si256(j % 2 ? _mm256_srli_epi16(nibbles, 4) : nibbles,
                                           _mm256_set1_epi8(0x0f));
    return _mm256_shuffle_epi8(
        _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codebook))), index);
  }
};

// half h's 8 sub-block scales of group g of a SUPER block, as bytes (Q2K: the low nibbles)
template <class F>
static inline __m128i sub_scales8(const uint8_t* block, int g, int h) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + F::SC_AT + 16 * g + 8 * h));
  if constexpr (F::PACKED_MINS) return _mm_and_si128(bytes, _mm_set1_epi8(15));
  else return bytes;
}

// Q2K's (Q4K's, Q5K's) minimums of super-block b folded for R rows of half h (8 columns) of a block:
// M = sum over its groups of m * sum(xq), two groups a VPMADDWD (each column's m of groups 2p
// and 2p + 1 as a 16-bit pair against the row's two sums), then acc[r][at] = fma(-(float)M,
// dmin * dx, acc)
template <class F, int R, int H>
static inline void fold_mins_avx2(const Acts& a, int64_t r0, const uint8_t* block, int64_t b, int h,
                                  int at, __m256 (&acc)[R][H]) {
  const int64_t groups = a.k / F::G, blocks = a.k / 256;
  __m256i min_sum[R];
  for (int r = 0; r < R; r++) min_sum[r] = _mm256_setzero_si256();
  for (int g = 0; g < F::GROUPS; g += 2) {
    __m128i pairs;  // each column's m of groups g and g + 1 side by side
    if constexpr (F::PACKED_MINS) {  // (Q2K: sc | m << 4, shifted down)
      const uint8_t* at_g = block + F::MIN_AT + 16 * g + 8 * h;
      pairs = _mm_unpacklo_epi8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(at_g)),
                                _mm_loadl_epi64(reinterpret_cast<const __m128i*>(at_g + 16)));
      pairs = _mm_srli_epi16(_mm_andnot_si128(_mm_set1_epi8(15), pairs), 4);
    } else {
      pairs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + F::MIN_AT + 16 * g + 16 * h));
    }
    const __m256i m = _mm256_cvtepu8_epi16(pairs);
    for (int r = 0; r < R; r++) {
      int32_t sums;  // the row's sum(xq) of groups g and g + 1
      std::memcpy(&sums, a.xsum + (r0 + r) * groups + b * F::GROUPS + g, 4);
      min_sum[r] = _mm256_add_epi32(min_sum[r], _mm256_madd_epi16(m, _mm256_set1_epi32(sums)));
    }
  }
  const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + F::DMIN_AT + 16 * h)));
  for (int r = 0; r < R; r++)
    acc[r][at] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(min_sum[r]),
                                  _mm256_mul_ps(dmin, _mm256_set1_ps(a.dx[(r0 + r) * blocks + b])), acc[r][at]);
}

// the 8 scales or minimums of half h's columns at `at`, float16 or (FIVE_BIT32) float32
template <class F>
static inline __m256 numbers8_avx2(const uint8_t* at, int h) {
  if constexpr (F::FLOAT32) return _mm256_loadu_ps(reinterpret_cast<const float*>(at) + 8 * h);
  else return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at + 16 * h)));
}

// R rows x H halves (8 columns each, from half h0) of one column tile, for CPUs without
// VPDPBUSD: VPMADDUBSW multiplies a slice by four activation bytes a column and adds pairs
// into 16-bit lanes; CHUNK slices' products are added there exactly (Q6K: u <= 63,
// 2 x 2 x 63 x 127 = 32004; FIVE_BIT: u <= 31, 4 x 2 x 31 x 127 = 31496; both < 2^15) before
// VPMADDWD by ones widens them into the group's 32-bit sum, the integer VPDPBUSD gives. The
// folds are columns_vnni's. `prefetch`: the pass that streams the tile asks for it
// SMALL_CODES_PREFETCH bytes ahead; a later pass asks for its share of the next tile, `ahead`
// (its lines a group, over the tile's groups).
template <class F, bool MIN, int R, int H>
static void halves_avx2(const Acts& a, int64_t r0, const uint8_t* tile, int h0, bool prefetch,
                        Ahead ahead, __m256 (&acc)[R][H]) {
  // Q2K, Q4K, Q5K: no code offset, so a group's slices (Q5K: four at a time) add up in 16
  // bits (Q2K: 4 x 2 x 3 x 128 = 3072; Q4K: 8 x 2 x 15 x 128 = 30720; Q5K: 4 x 2 x 31 x 128
  // = 31744 < 2^15) and VPMADDWD by the sub-block scale (16-bit pairs) gives sc times them
  constexpr bool SCALED_PAIRS = F::SUB_MINS;
  constexpr int CHUNK = SCALED_PAIRS ? (F::TOP ? 4 : F::G / 4) : F::SUPER ? 2 : 4;
  constexpr int64_t bytes = F::block_bytes(MIN), lines = (bytes + 63) / 64;
  const int64_t blocks = a.k / (F::G * F::GROUPS), groups = a.k / F::G, agroups = a.k / 32;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int r = 0; r < R; r++)
    for (int h = 0; h < H; h++) acc[r][h] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; b++) {
    const uint8_t* block = tile + b * bytes;
    __m256i super_sum[R][H];  // Q6K: S
    for (int r = 0; r < R; r++)
      for (int h = 0; h < H; h++) super_sum[r][h] = _mm256_setzero_si256();
    for (int g = 0; g < F::GROUPS; g++) {
      const int64_t at = b * F::GROUPS + g;
      if (prefetch)  // the block's lines spread over its groups
        for (int64_t line = lines * g / F::GROUPS; line < lines * (g + 1) / F::GROUPS; line++)
          _mm_prefetch(reinterpret_cast<const char*>(block + SMALL_CODES_PREFETCH + 64 * line), _MM_HINT_T0);
      for (int64_t line = 0; line < ahead.lines; line++)
        _mm_prefetch(reinterpret_cast<const char*>(ahead.at + (at * ahead.lines + line) * 64), _MM_HINT_T0);
      for (int h = 0; h < H; h++) {
        const int half = h0 + h;
        __m256i isum[R], part[R], sc_pairs;
        if constexpr (SCALED_PAIRS) {  // each column's sc in both 16-bit halves of its lane
          const __m128i sc8 = sub_scales8<F>(block, g, half);
          sc_pairs = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(sc8, sc8));
        } else {
          for (int r = 0; r < R; r++) isum[r] = _mm256_set1_epi32(a.bias[(r0 + r) * groups + at]);
        }
        each_slice_avx2<F>(block + g * F::GROUP_BYTES, half, [&](auto j, __m256i u) {
          constexpr int J = decltype(j)::value;
          for (int r = 0; r < R; r++) {
            int32_t four;
            std::memcpy(&four, a.xq + (r0 + r) * a.k + at * F::G + 4 * J, 4);
            const __m256i p = _mm256_maddubs_epi16(u, _mm256_set1_epi32(four));
            part[r] = J % CHUNK ? _mm256_add_epi16(part[r], p) : p;
            if constexpr (J % CHUNK == CHUNK - 1) {
              if constexpr (SCALED_PAIRS)
                super_sum[r][h] = _mm256_add_epi32(super_sum[r][h], _mm256_madd_epi16(part[r], sc_pairs));
              else
                isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(part[r], ones));
            }
          }
        });
        // (SCALED_PAIRS: sc times the group's sum is already in S)
        if constexpr (F::SUPER && !SCALED_PAIRS) {
          const __m256i sc = _mm256_cvtepi8_epi32(sub_scales8<F>(block, g, half));
          for (int r = 0; r < R; r++)
            super_sum[r][h] = _mm256_add_epi32(super_sum[r][h], _mm256_mullo_epi32(isum[r], sc));
        } else if constexpr (!F::SUPER) {
          const __m256 scale = numbers8_avx2<F>(block + F::SC_AT, half);
          for (int r = 0; r < R; r++) {
            const __m256 sd = _mm256_mul_ps(scale, _mm256_set1_ps(a.dx[(r0 + r) * agroups + at]));
            acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), sd, acc[r][h]);
          }
          if constexpr (MIN) {
            const __m256 mn = numbers8_avx2<F>(block + F::MIN_AT, half);
            for (int r = 0; r < R; r++)
              acc[r][h] = _mm256_fmadd_ps(mn, _mm256_set1_ps(a.sx[(r0 + r) * agroups + at]), acc[r][h]);
          }
        }
      }
    }
    if constexpr (F::SUPER)
      for (int h = 0; h < H; h++) {
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + F::D_AT + 16 * (h0 + h))));
        for (int r = 0; r < R; r++)
          acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(super_sum[r][h]),
                                      _mm256_mul_ps(d, _mm256_set1_ps(a.dx[(r0 + r) * blocks + b])), acc[r][h]);
        if constexpr (F::SUB_MINS) fold_mins_avx2<F>(a, r0, block, b, h0 + h, h, acc);
      }
  }
}

// Q6K on AVX2 for many rows: each column tile decoded once a call (decode_q6k_avx2), so that a
// pass of rows neither unpacks codes nor pays the code offset and the sub-block scale per row.
// The decoded codes are signed, q = code (-32..31), as VPMADDUBSW's signed operand, and the
// activations unsigned, xu = xq + 128; per group and column, VPMADDWD by the sub-block scale
// (sc, held as 16-bit pairs) gives sc * sum((xq + 128) q), exact (a 16-bit lane adds 2 x 2
// products: |.| <= 4 x 255 x 32 = 32640 < 2^15). Over a super-block that is S + 128 C, with
// C = sum over its groups of sc * sum(q), the weights' own: decoded once per column and
// subtracted in integers, so S, and the fold, are halves_avx2's: the same bits.
namespace q6k_decoded {
constexpr int64_t SLICES = 4 * 32;               // a half group's codes: 4 slices of 32 bytes
constexpr int64_t HALF_GROUP = SLICES + 32;      // then its 8 columns' sc as 16-bit pairs
constexpr int64_t BLOCK = 16 * 2 * HALF_GROUP;   // a super-block's 16 groups x 2 halves
constexpr int64_t CORRECTION = 2 * 32;           // then its 2 halves' 128 C (int32 x 8)
constexpr int64_t bytes(int64_t k) { return k / 256 * (BLOCK + CORRECTION); }
}  // namespace q6k_decoded

// a packed Q6K (or Q3K) column tile into `out` (32-byte aligned, q6k_decoded::bytes(k)),
// streaming the tile SMALL_CODES_PREFETCH ahead
template <class F>
static void decode_q6k_avx2(const uint8_t* tile, int64_t k, uint8_t* out) {
  using namespace q6k_decoded;
  constexpr int64_t bytes = F::block_bytes(false), lines = (bytes + 63) / 64;
  const __m256i offset = _mm256_set1_epi8(F::OFFSET), ones8 = _mm256_set1_epi8(1),
                ones16 = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < k / 256; b++) {
    const uint8_t* block = tile + b * bytes;
    uint8_t* to = out + b * (BLOCK + CORRECTION);
    for (int64_t line = 0; line < lines; line++)
      _mm_prefetch(reinterpret_cast<const char*>(block + SMALL_CODES_PREFETCH + 64 * line), _MM_HINT_T0);
    __m256i correction[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    for (int g = 0; g < 16; g++)
      for (int h = 0; h < 2; h++) {
        uint8_t* half = to + (g * 2 + h) * HALF_GROUP;
        __m256i sum = _mm256_setzero_si256();  // sum(q) of each column (32-bit lanes)
        each_slice_avx2<F>(block + g * F::GROUP_BYTES, h, [&](auto j, __m256i u) {
          const __m256i q = _mm256_sub_epi8(u, offset);
          _mm256_store_si256(reinterpret_cast<__m256i*>(half + 32 * decltype(j)::value), q);
          sum = _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, q), ones16));
        });
        const __m128i sc = sub_scales8<F>(block, g, h);
        _mm256_store_si256(reinterpret_cast<__m256i*>(half + SLICES),
                           _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(sc, sc)));
        correction[h] = _mm256_add_epi32(correction[h], _mm256_mullo_epi32(sum, _mm256_cvtepi8_epi32(sc)));
      }
    for (int h = 0; h < 2; h++)
      _mm256_store_si256(reinterpret_cast<__m256i*>(to + BLOCK + 32 * h), _mm256_slli_epi32(correction[h], 7));
  }
}

// R rows of half h of a decoded Q6K tile (`tile` the packed one, for its d); `ahead` as
// halves_avx2's
template <class F, int R>
static void q6k_decoded_half_avx2(const Acts& a, int64_t r0, const uint8_t* tile, const uint8_t* decoded,
                                  int h, Ahead ahead, __m256 (&acc)[R][1]) {
  using namespace q6k_decoded;
  const int64_t blocks = a.k / 256;
  const uint8_t* rows = a.xu + r0 * a.k;  // the pass's rows, interleaved
  for (int r = 0; r < R; r++) acc[r][0] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; b++) {
    const uint8_t* from = decoded + b * (BLOCK + CORRECTION);
    __m256i super_sum[R];  // S + 128 C
    for (int r = 0; r < R; r++) super_sum[r] = _mm256_setzero_si256();
    for (int g = 0; g < 16; g++) {
      const int64_t at = b * 16 + g;
      for (int64_t line = 0; line < ahead.lines; line++)
        _mm_prefetch(reinterpret_cast<const char*>(ahead.at + (at * ahead.lines + line) * 64), _MM_HINT_T0);
      const uint8_t* half = from + (g * 2 + h) * HALF_GROUP;
      const __m256i sc = _mm256_load_si256(reinterpret_cast<const __m256i*>(half + SLICES));
      __m256i part[R];
#pragma GCC unroll 4
      for (int j = 0; j < 4; j++) {
        const __m256i q = _mm256_load_si256(reinterpret_cast<const __m256i*>(half + 32 * j));
        for (int r = 0; r < R; r++) {
          int32_t four;
          std::memcpy(&four, rows + ((at * 4 + j) * R + r) * 4, 4);
          const __m256i p = _mm256_maddubs_epi16(_mm256_set1_epi32(four), q);
          part[r] = j % 2 ? _mm256_add_epi16(part[r], p) : p;
          if (j % 2) super_sum[r] = _mm256_add_epi32(super_sum[r], _mm256_madd_epi16(part[r], sc));
        }
      }
    }
    const __m256i correction = _mm256_load_si256(reinterpret_cast<const __m256i*>(from + BLOCK + 32 * h));
    const uint8_t* block = tile + b * F::block_bytes(false);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + F::D_AT + 16 * h)));
    for (int r = 0; r < R; r++)
      acc[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(super_sum[r], correction)),
                                  _mm256_mul_ps(d, _mm256_set1_ps(a.dx[(r0 + r) * blocks + b])), acc[r][0]);
    if constexpr (F::SUB_MINS) fold_mins_avx2<F>(a, r0, block, b, h, 0, acc);
  }
}

// rows a pass over a decoded half tile (their partial and super-block sums fit the registers)
#define Q6K_DECODED_ROWS 6

// xq + 128 [m, k] with each pass's rows (Q6K_DECODED_ROWS from row 0, the rest in the last)
// interleaved by words of 4 inputs: word w of the pass's row r at (w R + r) 4 after its first
// row's start, so that a pass reads all its rows through one pointer
static void q6k_interleave(const int8_t* xq, int64_t m, int64_t k, uint8_t* out) {
  at::parallel_for(0, (m + Q6K_DECODED_ROWS - 1) / Q6K_DECODED_ROWS, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t r0 = p0 * Q6K_DECODED_ROWS; r0 < std::min(m, p1 * Q6K_DECODED_ROWS); r0 += Q6K_DECODED_ROWS) {
      const int64_t rows = std::min<int64_t>(Q6K_DECODED_ROWS, m - r0);
      for (int64_t r = 0; r < rows; r++)
        for (int64_t w = 0; w < k / 4; w++) {
          uint32_t word;  // a byte x of int8 plus 128 is x xor 0x80
          std::memcpy(&word, xq + (r0 + r) * k + 4 * w, 4);
          word ^= 0x80808080u;
          std::memcpy(out + r0 * k + (w * rows + r) * 4, &word, 4);
        }
    }
  });
}

// Q6K's (or Q3K's) column tiles t0..t1 decoded (a.xu set), each in passes of up to
// Q6K_DECODED_ROWS rows over one half
template <class F>
static void q6k_columns_decoded_avx2(const Acts& a, int64_t m, const uint8_t* packed,
                                     const float* residual, float* y, int64_t n, int64_t t0, int64_t t1) {
  const int64_t tile_bytes = a.k / 256 * F::block_bytes(false);
  // a byte vector aligned by hand (a vector of __m256i is not: this file's default target)
  std::vector<uint8_t> buffer(q6k_decoded::bytes(a.k) + 32);
  uint8_t* decoded = buffer.data() + (-reinterpret_cast<uintptr_t>(buffer.data()) & 31);
  for (int64_t t = t0; t < t1; t++) {
    const uint8_t* tile = packed + t * tile_bytes;
    decode_q6k_avx2<F>(tile, a.k, decoded);
    const uint8_t* next = t + 1 < t1 ? tile + tile_bytes : nullptr;
    const int64_t passes = 2 * ((m + Q6K_DECODED_ROWS - 1) / Q6K_DECODED_ROWS);
    for (int64_t r0 = 0; r0 < m; r0 += Q6K_DECODED_ROWS)
      for (int h = 0; h < 2; h++) {
        const Ahead ahead = ahead_of_pass(2 * (r0 / Q6K_DECODED_ROWS) + h, passes, next, tile_bytes / 64, a.k / 16);
        auto pass = [&](auto rows) {
          constexpr int R = decltype(rows)::value;
          __m256 acc[R][1];
          q6k_decoded_half_avx2<F, R>(a, r0, tile, decoded, h, ahead, acc);
          k_avx2::store_halves_avx2<R, 1>(acc, r0, t * 16 + 8 * h, residual, y, n);
        };
        switch (std::min<int64_t>(Q6K_DECODED_ROWS, m - r0)) {
#define Q6K_DECODED_CASE(R) case R: pass(std::integral_constant<int, R>{}); break;
          Q6K_DECODED_CASE(6) Q6K_DECODED_CASE(5) Q6K_DECODED_CASE(4)
          Q6K_DECODED_CASE(3) Q6K_DECODED_CASE(2) Q6K_DECODED_CASE(1)
#undef Q6K_DECODED_CASE
        }
      }
  }
}

// each tile in k_avx2::row_passes
template <class F, bool MIN>
static void columns_avx2(const Acts& a, int64_t m, const uint8_t* packed, const float* residual,
                         float* y, int64_t n, int64_t t0, int64_t t1) {
  const int64_t groups = a.k / F::G, tile_bytes = a.k / (F::G * F::GROUPS) * F::block_bytes(MIN);
  for (int64_t t = t0; t < t1; t++) {
    const uint8_t* tile = packed + t * tile_bytes;
    const uint8_t* next = t + 1 < t1 ? tile + tile_bytes : nullptr;
    auto pass = [&](auto rows, auto halves, int64_t r0, int h0, bool first, Ahead ahead) {
      constexpr int R = decltype(rows)::value, H = decltype(halves)::value;
      __m256 acc[R][H];
      halves_avx2<F, MIN, R, H>(a, r0, tile, h0, first, ahead, acc);
      k_avx2::store_halves_avx2<R, H>(acc, r0, t * 16 + 8 * h0, residual, y, n);
    };
    if (F::SUB_MINS && (m == 3 || m == 4)) {
      // Q2K (Q4K, Q5K) holds each super-block's integer sums beside the float accumulators: 3 or 4 rows
      // over both halves at once need more than AVX2's 16 registers (4 rows: 8 + 8 and the
      // group's partial sums), so they take one half a pass, the second from cache (measured
      // on the 1.5B's Q2_K matrices: 4 rows 0.61x the time, 3 rows 0.84x; Q6K's passes, whose
      // code differs, ran 1.1-1.2x slower so)
      using one = std::integral_constant<int, 1>;
      for (int h = 0; h < 2; h++) {
        const Ahead ahead = ahead_of_pass(h, 2, next, tile_bytes / 64, groups);
        if (m == 4) pass(std::integral_constant<int, 4>{}, one{}, 0, h, h == 0, ahead);
        else pass(std::integral_constant<int, 3>{}, one{}, 0, h, h == 0, ahead);
      }
    } else {
      k_avx2::row_passes(m, next, tile_bytes / 64, groups, pass);
    }
  }
}
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")

// A codebook layout's sixteen codes plus 128 (VPDPBUSD's unsigned operand), in each 128-bit
// lane for VPSHUFB; zeros for the other layouts
static inline __m512i codebook_table(const int8_t* codebook) {
  if (!codebook) return _mm512_setzero_si512();
  const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codebook));
  return _mm512_xor_si512(_mm512_broadcast_i32x4(codes), _mm512_set1_epi8((char)0x80));
}

// slice j of a packed group as VPDPBUSD's unsigned operand: its nibbles, with its top bits
// moved to bit 4 and up ((nibbles & 15) | top in one ternary-logic operation); a codebook
// layout's: the code each nibble names plus 128, looked up in `table` (codebook_table)
template <class F, int J>
static inline __m512i slice(const uint8_t* grp, __m512i table) {
  if constexpr (F::CODE_BITS == 2)  // Q2K: a group's four slices at bits 2j of its 64 bytes
    return _mm512_and_si512(_mm512_srli_epi16(_mm512_loadu_si512(grp), 2 * J), _mm512_set1_epi8(3));
  const __m512i nibbles = _mm512_loadu_si512(grp + 64 * (J / 2));
  const __m512i low = J % 2 ? _mm512_srli_epi16(nibbles, 4) : nibbles;
  if constexpr (F::TOP == 0) {
    const __m512i index = _mm512_and_si512(low, _mm512_set1_epi8(0x0f));
    return F::CODEBOOK ? _mm512_shuffle_epi8(table, index) : index;
  }
  const __m512i tops = _mm512_loadu_si512(grp + 8 * F::G);
  constexpr int shift = 4 - F::TOP * J;  // from bit TOP j to bit 4
  const __m512i moved = shift > 0 ? _mm512_slli_epi16(tops, shift)
                        : shift < 0 ? _mm512_srli_epi16(tops, -shift) : tops;
  const __m512i top = _mm512_and_si512(moved, _mm512_set1_epi8((char)(((1 << F::TOP) - 1) << 4)));
  return _mm512_ternarylogic_epi32(low, top, _mm512_set1_epi8(0x0f), 0xEC);  // (A & C) | B
}

// the 16 columns' float16 numbers at `at`
static inline __m512 halves16(const uint8_t* at) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)));
}

// the 16 columns' sc of group g of a SUPER block, as int32 (Q2K: the low nibbles; Q4K, Q5K:
// bytes 0..63)
template <class F>
static inline __m512i sub_scales16(const uint8_t* block, int g) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + F::SC_AT + 16 * g));
  if constexpr (F::PACKED_MINS) return _mm512_and_si512(_mm512_cvtepu8_epi32(bytes), _mm512_set1_epi32(15));
  else if constexpr (F::SUB_MINS) return _mm512_cvtepu8_epi32(bytes);
  else return _mm512_cvtepi8_epi32(bytes);
}

// a Q6K (Q3K) super-block's fold for one row: acc = fma(S, d * dx, acc)
template <class F>
static inline __m512 fold_q6k(const uint8_t* block, __m512i super_sum, float dx, __m512 acc) {
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(super_sum),
                         _mm512_mul_ps(halves16(block + F::D_AT), _mm512_set1_ps(dx)), acc);
}

// the 16 columns' m of groups g and g + 1 of a SUB_MINS block as 16-bit pairs (Q2K: sc | m << 4
// of both groups side by side, shifted down; Q4K, Q5K: held so)
template <class F>
static inline __m512i min_pairs16(const uint8_t* block, int g) {
  if constexpr (F::PACKED_MINS) {
    const __m128i even = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + F::MIN_AT + 16 * g));
    const __m128i odd = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + F::MIN_AT + 16 * g + 16));
    const __m256i both = _mm256_set_m128i(_mm_unpackhi_epi8(even, odd), _mm_unpacklo_epi8(even, odd));
    return _mm512_srli_epi16(_mm512_cvtepu8_epi16(both), 4);
  } else {
    return _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + F::MIN_AT + 16 * g)));
  }
}

// Q2K's (Q4K's, Q5K's) minimums of super-block b folded for one row: M = sum over its groups of m *
// sum(xq), two groups a VPDPWSSD (`pairs`: min_pairs16 of groups 2p and 2p + 1, against the
// row's two sums), then acc = fma(-(float)M, dmin * dx, acc) (fold_mins_avx2's numbers)
template <class F>
static inline __m512 fold_mins_vnni(const Acts& a, int64_t row, const __m512i (&pairs)[F::GROUPS / 2],
                                    const uint8_t* block, int64_t b, __m512 acc) {
  const int64_t groups = a.k / F::G, blocks = a.k / 256;
  __m512i min_sum = _mm512_setzero_si512();
  for (int p = 0; p < F::GROUPS / 2; p++) {
    int32_t sums;  // the row's sum(xq) of group 2p (low 16 bits) and 2p + 1 (high)
    std::memcpy(&sums, a.xsum + row * groups + b * F::GROUPS + 2 * p, 4);
    min_sum = _mm512_dpwssd_epi32(min_sum, pairs[p], _mm512_set1_epi32(sums));
  }
  const __m512 dmin_dx = _mm512_mul_ps(halves16(block + F::DMIN_AT), _mm512_set1_ps(a.dx[row * blocks + b]));
  return _mm512_fnmadd_ps(_mm512_cvtepi32_ps(min_sum), dmin_dx, acc);
}

// every slice of a group, J = 0 .. G / 4 - 1, through `use(J, slice)` (`table`: a codebook
// layout's, codebook_table)
template <class F, int J = 0, class Use>
static inline void each_slice(const uint8_t* const* grp, __m512i table, Use&& use) {
  if constexpr (J < F::G / 4) {
    use(J, [&](int t) { return slice<F, J>(grp[t], table); });
    each_slice<F, J + 1>(grp, table, use);
  }
}

// R rows x T column tiles a pass (as q8_blocks.h's tiles_vnni): each unpacked slice serves R
// rows, each broadcast of four activation bytes T tiles; with few accumulators a group's
// VPDPBUSD go into two chains. `ahead`: the next tiles' weights, `ahead_lines` cache lines a
// group, which the passes after a tile's first ask for (null: the first pass, which asks for
// its own stream SMALL_CODES_PREFETCH bytes ahead).
//
// blocks_vnni: blocks b0..b1 of it added to `acc`; DECODED: b1 = b0 + 1, the block's slices
// read from `decoded` (decode_block's, the T tiles' one after the other) instead of unpacked.
template <class F, bool MIN, int R, int T, bool DECODED = false>
static inline void blocks_vnni(const Acts& a, int64_t r0, const uint8_t* tile, int64_t tile_bytes,
                               const uint8_t* ahead, int64_t ahead_lines, int64_t b0, int64_t b1,
                               const uint8_t* decoded, __m512 (&acc)[R][T]) {
  constexpr int CH = R * T < 4 ? 2 : 1;
  constexpr int64_t bytes = F::block_bytes(MIN), lines = (bytes + 63) / 64;
  const int64_t blocks = a.k / (F::G * F::GROUPS), groups = a.k / F::G, agroups = a.k / 32;
  const __m512i table = codebook_table(a.codebook);
  for (int64_t b = b0; b < b1; b++) {
    __m512i super_sum[R][T];  // Q6K, Q3K: S
    if constexpr (F::SUPER)
      for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) super_sum[r][t] = _mm512_setzero_si512();
    for (int g = 0; g < F::GROUPS; g++) {
      const int64_t at = b * F::GROUPS + g;
      if (ahead) {
        for (int64_t line = 0; line < ahead_lines; line++)
          _mm_prefetch(reinterpret_cast<const char*>(ahead + (at * ahead_lines + line) * 64), _MM_HINT_T0);
      } else if constexpr (!DECODED) {  // the block's lines spread over its groups
        for (int t = 0; t < T; t++)
          for (int64_t line = lines * g / F::GROUPS; line < lines * (g + 1) / F::GROUPS; line++)
            _mm_prefetch(reinterpret_cast<const char*>(tile + t * tile_bytes + b * bytes +
                                                       SMALL_CODES_PREFETCH + 64 * line), _MM_HINT_T0);
      }
      __m512i sum[CH][R][T];
      for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) {  // (Q2K, Q4K, Q5K: no code offset, no bias)
          sum[0][r][t] = F::SUB_MINS ? _mm512_setzero_si512() : _mm512_set1_epi32(a.bias[(r0 + r) * groups + at]);
          for (int ch = 1; ch < CH; ch++) sum[ch][r][t] = _mm512_setzero_si512();
        }
      const uint8_t* grp[T];
      for (int t = 0; t < T; t++) grp[t] = tile + t * tile_bytes + b * bytes + g * F::GROUP_BYTES;
      each_slice<F>(grp, table, [&](int j, auto unpack) {
        __m512i w[T];
        for (int t = 0; t < T; t++)
          if constexpr (DECODED)
            w[t] = _mm512_load_si512(decoded + DECODED_BLOCK_BYTES * t + 64 * (g * (F::G / 4) + j));
          else
            w[t] = unpack(t);
        for (int r = 0; r < R; r++) {
          int32_t four;
          std::memcpy(&four, a.xq + (r0 + r) * a.k + at * F::G + 4 * j, 4);
          const __m512i xb = _mm512_set1_epi32(four);
          for (int t = 0; t < T; t++) sum[j % CH][r][t] = _mm512_dpbusd_epi32(sum[j % CH][r][t], w[t], xb);
        }
      });
      for (int t = 0; t < T; t++) {
        const uint8_t* block = tile + t * tile_bytes + b * bytes;
        if constexpr (F::SUPER) {
          const __m512i sc = sub_scales16<F>(block, g);
          for (int r = 0; r < R; r++) {
            __m512i isum = sum[0][r][t];
            for (int ch = 1; ch < CH; ch++) isum = _mm512_add_epi32(isum, sum[ch][r][t]);
            super_sum[r][t] = _mm512_add_epi32(super_sum[r][t], _mm512_mullo_epi32(isum, sc));
          }
        } else {  // (the activations' group of 32 holds this group: CODEBOOK16's are 16)
          const int64_t at32 = at * F::G / 32;
          const __m512 scale = q8blocks::scales16(block + F::SC_AT, !F::FLOAT32);
          for (int r = 0; r < R; r++) {
            __m512i isum = sum[0][r][t];
            for (int ch = 1; ch < CH; ch++) isum = _mm512_add_epi32(isum, sum[ch][r][t]);
            const __m512 sd = _mm512_mul_ps(scale, _mm512_set1_ps(a.dx[(r0 + r) * agroups + at32]));
            acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), sd, acc[r][t]);
          }
          if constexpr (MIN) {
            const __m512 mn = q8blocks::scales16(block + F::MIN_AT, !F::FLOAT32);
            for (int r = 0; r < R; r++)
              acc[r][t] = _mm512_fmadd_ps(mn, _mm512_set1_ps(a.sx[(r0 + r) * agroups + at32]), acc[r][t]);
          }
        }
      }
    }
    if constexpr (F::SUPER)
      for (int t = 0; t < T; t++) {
        const uint8_t* block = tile + t * tile_bytes + b * bytes;
        // the m pairs: Q4K's, Q5K's widened once for the pass's rows; Q2K's again for each row (once
        // for a pass's rows, the 1.5B's Q2_K forwards took 1.05x the time at 16 and 64 rows on
        // a Zen 4)
        __m512i pairs[F::GROUPS / 2];
        if constexpr (F::SUB_MINS && !F::PACKED_MINS)
          for (int p = 0; p < F::GROUPS / 2; p++) pairs[p] = min_pairs16<F>(block, 2 * p);
        for (int r = 0; r < R; r++) {
          acc[r][t] = fold_q6k<F>(block, super_sum[r][t], a.dx[(r0 + r) * blocks + b], acc[r][t]);
          if constexpr (F::PACKED_MINS)
            for (int p = 0; p < F::GROUPS / 2; p++) pairs[p] = min_pairs16<F>(block, 2 * p);
          if constexpr (F::SUB_MINS) acc[r][t] = fold_mins_vnni<F>(a, r0 + r, pairs, block, b, acc[r][t]);
        }
      }
  }
}

template <class F, bool MIN, int R, int T>
static void tiles_vnni(const Acts& a, int64_t r0, const uint8_t* tile, int64_t tile_bytes,
                       const uint8_t* ahead, int64_t ahead_lines, __m512 (&acc)[R][T]) {
  for (int r = 0; r < R; r++)
    for (int t = 0; t < T; t++) acc[r][t] = _mm512_setzero_ps();
  blocks_vnni<F, MIN, R, T>(a, r0, tile, tile_bytes, ahead, ahead_lines, 0,
                            a.k / (F::G * F::GROUPS), nullptr, acc);
}

// one super-block's slices as VPDPBUSD's operands (each_slice's), group-major, asking for the
// tile's stream SMALL_CODES_PREFETCH bytes ahead
template <class F, bool MIN>
static inline void decode_block(const uint8_t* block, __m512i table, uint8_t* out) {
  constexpr int64_t lines = (F::block_bytes(MIN) + 63) / 64;
  for (int g = 0; g < F::GROUPS; g++) {
    for (int64_t line = lines * g / F::GROUPS; line < lines * (g + 1) / F::GROUPS; line++)
      _mm_prefetch(reinterpret_cast<const char*>(block + SMALL_CODES_PREFETCH + 64 * line),
                   _MM_HINT_T0);
    const uint8_t* grp = block + g * F::GROUP_BYTES;
    each_slice<F>(&grp, table, [&](int j, auto unpack) {
      _mm512_store_si512(out + 64 * (g * (F::G / 4) + j), unpack(0));
    });
  }
}

// rows in passes of P over T column tiles; `next`: the tiles this thread reads after these
// (null if none), whose weights the passes after the first ask for, spread over their groups
template <class F, bool MIN, int T, int P = 4>
static void rows_vnni(const Acts& a, int64_t m, const uint8_t* tile, const uint8_t* next,
                      int64_t t, const float* residual, float* y, int64_t n) {
  const int64_t groups = a.k / F::G;
  const int64_t tile_bytes = a.k / (F::G * F::GROUPS) * F::block_bytes(MIN);
  const int64_t lines = T * tile_bytes / 64;
  k_avx512::row_passes<P>(m, next, lines, groups, [&](auto rows, int64_t r0, Ahead ahead) {
    constexpr int R = decltype(rows)::value;
    __m512 acc[R][T];
    tiles_vnni<F, MIN, R, T>(a, r0, tile, tile_bytes, ahead.at, ahead.lines, acc);
    k_avx512::store_tiles<R, T>(acc, R, r0, t, n, residual, y);
  });
}

// rows r0.. of T tiles' accumulators to and from `sums` (16 T floats a row)
template <int R, int T>
static inline void load_sums(const float* sums, int64_t r0, __m512 (&acc)[R][T]) {
  for (int r = 0; r < R; r++)
    for (int i = 0; i < T; i++) acc[r][i] = _mm512_loadu_ps(sums + 16 * (T * (r0 + r) + i));
}
template <int R, int T>
static inline void store_sums(const __m512 (&acc)[R][T], int64_t r0, float* sums) {
  for (int r = 0; r < R; r++)
    for (int i = 0; i < T; i++) _mm512_storeu_ps(sums + 16 * (T * (r0 + r) + i), acc[r][i]);
}

// Many rows over a SUPER layout: passes of 4 rows over a tile pair would each unpack its slices
// again (on a Zen 5 the unpacking's shifts and ands take VPDPBUSD's ports: scripts/
// vnni_ports.cpp), so each super-block of the pair is decoded once into cache and every pass
// runs over it, the passes' accumulators kept in memory between super-blocks. The same
// integers and float operations in the same order: the direct passes' bits. A last odd tile
// takes the direct passes. (Fewer rows lose: SUPER_DECODE_MIN_ROWS; whole tiles decoded
// before the passes, their accumulators in registers, took 1.05-1.19x the direct passes' time
// at 12 to 64 rows and 1.02x on a 512-token prompt.)
template <class F, bool MIN, int T>
static void tiles_decoded(const Acts& a, int64_t m, const uint8_t* tiles, int64_t tile_bytes,
                          int64_t t, const float* residual, float* y, int64_t n) {
  constexpr int P = 4;
  constexpr int64_t bytes = F::block_bytes(MIN);
  const int64_t blocks = a.k / (F::G * F::GROUPS);
  const __m512i table = codebook_table(a.codebook);
  alignas(64) uint8_t decoded[T * DECODED_BLOCK_BYTES];
  std::vector<float> sums(16 * T * m);  // each row's T tiles' accumulators
  // (the passes written out: a helper lambda taking them by reference lost the gain)
  for (int64_t b = 0; b < blocks; b++) {
    for (int i = 0; i < T; i++)
      decode_block<F, MIN>(tiles + i * tile_bytes + b * bytes, table,
                           decoded + i * DECODED_BLOCK_BYTES);
    for (int64_t r0 = 0; r0 < m; r0 += P)
      k_avx512::with_rows<P>(std::min<int64_t>(P, m - r0), [&](auto rows) {
        constexpr int R = decltype(rows)::value;
        __m512 acc[R][T];
        load_sums(sums.data(), r0, acc);
        blocks_vnni<F, MIN, R, T, true>(a, r0, tiles, tile_bytes, nullptr, 0, b, b + 1, decoded,
                                        acc);
        store_sums(acc, r0, sums.data());
      });
  }
  for (int64_t r0 = 0; r0 < m; r0 += P)
    k_avx512::with_rows<P>(std::min<int64_t>(P, m - r0), [&](auto rows) {
      constexpr int R = decltype(rows)::value;
      __m512 acc[R][T];
      load_sums(sums.data(), r0, acc);
      k_avx512::store_tiles<R, T>(acc, R, r0, t, n, residual, y);
    });
}

template <class F, bool MIN>
static void columns_vnni_decoded(const Acts& a, int64_t m, const uint8_t* packed,
                                 const float* residual, float* y, int64_t n, int64_t t0,
                                 int64_t t1) {
  const int64_t tile_bytes = a.k / (F::G * F::GROUPS) * F::block_bytes(MIN);
  int64_t t = t0;  // (three tiles a step: 1.02-1.03x the time of two at 128-256 rows)
  for (; t + 2 <= t1; t += 2)
    tiles_decoded<F, MIN, 2>(a, m, packed + t * tile_bytes, tile_bytes, t, residual, y, n);
  if (t < t1)
    rows_vnni<F, MIN, 1, VNNI_ONE_PASS_ROWS>(a, m, packed + t * tile_bytes, nullptr, t, residual,
                                             y, n);
}

template <class F, bool MIN>
static void columns_vnni(const Acts& a, int64_t m, const uint8_t* packed, const float* residual,
                         float* y, int64_t n, int64_t t0, int64_t t1) {
  if constexpr (F::SUPER)
    if (m >= SUPER_DECODE_MIN_ROWS)
      return columns_vnni_decoded<F, MIN>(a, m, packed, residual, y, n, t0, t1);
  const int64_t tile_bytes = a.k / (F::G * F::GROUPS) * F::block_bytes(MIN);
  int64_t t = t0;
  // three tiles a pass (the last two or one as they fall) where rows are many enough to be
  // bound by arithmetic, one stream of weights where few rows leave it bound by memory (as the
  // Q4 and block int8 kernels). (Three against two, the 1.5B's forwards after 256 positions on
  // a Zen 5: 12 to 64 rows 0.935-0.985x the time in three runs, scripts/kernels_ab.py)
  for (; m > VNNI_ONE_PASS_ROWS && t + 3 <= t1; t += 3)
    rows_vnni<F, MIN, 3>(a, m, packed + t * tile_bytes,
                         t + 6 <= t1 ? packed + (t + 3) * tile_bytes : nullptr, t, residual, y, n);
  for (; m > VNNI_ONE_PASS_ROWS && t + 2 <= t1; t += 2)
    rows_vnni<F, MIN, 2>(a, m, packed + t * tile_bytes,
                         t + 4 <= t1 ? packed + (t + 2) * tile_bytes : nullptr, t, residual, y, n);
  for (; t < t1; t++)
    rows_vnni<F, MIN, 1, VNNI_ONE_PASS_ROWS>(
        a, m, packed + t * tile_bytes, t + 2 <= t1 ? packed + (t + 1) * tile_bytes : nullptr, t,
        residual, y, n);
}

// a FIVE_BIT tile's groups in block int8's layout (q8_blocks.h, groups of 32: the slices of u,
// then the scales and minimums, float16 as they are), asking for the tile's stream
// SMALL_CODES_PREFETCH bytes ahead
template <class F, bool MIN>
static void decode_tile(const uint8_t* tile, int64_t k, uint8_t* out) {
  constexpr int64_t bytes = F::block_bytes(MIN), lines = (bytes + 63) / 64;
  constexpr int64_t out_bytes = q8blocks::block_bytes(F::G, MIN, true);
  for (int64_t b = 0; b < k / (F::G * F::GROUPS); b++) {
    const uint8_t* block = tile + b * bytes;
    for (int g = 0; g < F::GROUPS; g++) {
      for (int64_t line = lines * g / F::GROUPS; line < lines * (g + 1) / F::GROUPS; line++)
        _mm_prefetch(reinterpret_cast<const char*>(block + SMALL_CODES_PREFETCH + 64 * line), _MM_HINT_T0);
      const uint8_t* grp = block + g * F::GROUP_BYTES;
      uint8_t* dst = out + (b * F::GROUPS + g) * out_bytes;
      each_slice<F>(&grp, _mm512_setzero_si512(), [&](int j, auto unpack) {
        _mm512_storeu_si512(dst + 64 * j, unpack(0));
      });
      std::memcpy(dst + 16 * F::G, block + F::SC_AT, MIN ? 64 : 32);  // scales, minimums
    }
  }
}

// More rows than one pass holds: each pass would unpack the codes again, so a tile (two, as
// q8_blocks.h pairs them) is decoded once into block int8's layout, in cache, and block int8's
// kernel runs every row over it, its later passes asking for the next tiles' packed weights.
// Its bits are the direct kernel's: the same integers and the same float operations.
template <class F, bool MIN>
static void columns_decoded(const q8blocks::Acts& a, int64_t m, const uint8_t* packed,
                            const float* residual, float* y, int64_t n, int64_t t0, int64_t t1) {
  const int64_t tile_bytes = a.k / (F::G * F::GROUPS) * F::block_bytes(MIN);
  const int64_t decoded_bytes = a.k / F::G * q8blocks::block_bytes(F::G, MIN, true);
  std::vector<uint8_t> decoded(2 * decoded_bytes);
  for (int64_t t = t0; t < t1; t += 2) {
    const int64_t count = std::min<int64_t>(2, t1 - t);
    for (int64_t i = 0; i < count; i++)
      decode_tile<F, MIN>(packed + (t + i) * tile_bytes, a.k, decoded.data() + i * decoded_bytes);
    const uint8_t* next = t + count < t1 ? packed + (t + count) * tile_bytes : nullptr;
    const int64_t next_bytes = std::min<int64_t>(2, t1 - t - count) * tile_bytes;
    if (count == 2)
      q8blocks::rows_vnni<2, F::G, MIN, true>(a, m, decoded.data(), next, t, residual, y, n, next_bytes);
    else
      q8blocks::rows_vnni<1, F::G, MIN, true>(a, m, decoded.data(), next, t, residual, y, n, next_bytes);
  }
}
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c,amx-tile,amx-int8")
// Q6K on the AMX tiles. A column tile is decoded once a call into weight tiles whose bytes hold
// v = sc * code of each input (the sub-block scale inside the weight, -4064..4096) as v = 256 hi
// + lo, lo unsigned and hi signed: per 64 inputs (a K step) one tile of lo, one of hi, each 16
// rows of 64 bytes in VPDPBUSD's operand order (the packed slices' own order). Then for every
// block of 16 rows and super-block, TDPBSUD (activations x lo) and TDPBSSD (activations x hi)
// sum all 256 inputs in two tiles, and S = lo sums + 256 hi sums is the direct kernel's exact
// S, folded as it folds it.

// bytes of one K step's two weight tiles
constexpr int64_t Q6K_STEP_BYTES = 2 * 1024;

// a Q6K tile's weight tiles (k / 64 steps of Q6K_STEP_BYTES), asking for the tile's stream
// SMALL_CODES_PREFETCH bytes ahead
static void decode_q6k_tile(const uint8_t* tile, int64_t k, uint8_t* out) {
  using F = Q6K;
  constexpr int64_t bytes = F::block_bytes(false), lines = (bytes + 63) / 64;
  // byte 16 L + 4 c + i of a slice belongs to column 4 L + c: its sc's place in the 16 bytes
  // broadcast to every 128-bit lane
  alignas(64) int8_t columns_of_bytes[64];
  for (int at = 0; at < 64; at++) columns_of_bytes[at] = (int8_t)(4 * (at / 16) + at % 16 / 4);
  const __m512i column_of_byte = _mm512_load_si512(columns_of_bytes);
  const __m512i even = _mm512_set1_epi16(0x00ff), code_offset = _mm512_set1_epi16(F::OFFSET);
  for (int64_t b = 0; b < k / 256; b++) {
    const uint8_t* block = tile + b * bytes;
    for (int g = 0; g < F::GROUPS; g++) {
      for (int64_t line = lines * g / F::GROUPS; line < lines * (g + 1) / F::GROUPS; line++)
        _mm_prefetch(reinterpret_cast<const char*>(block + SMALL_CODES_PREFETCH + 64 * line), _MM_HINT_T0);
      const __m512i sc = _mm512_shuffle_epi8(
          _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + F::SC_AT + 16 * g))),
          column_of_byte);
      // sc of the even and the odd bytes, each in a 16-bit lane's low or high byte, the other 0
      const __m512i sc_even = _mm512_and_si512(sc, even), sc_odd = _mm512_andnot_si512(even, sc);
      const __m512i offset = _mm512_maddubs_epi16(code_offset, sc_even);  // offset * sc
      const int64_t first = g * (F::G / 4);  // the group's first slice in its super-block
      uint8_t* lo = out + (b * 4 + first / 16) * Q6K_STEP_BYTES + first % 16 * 64;
      const uint8_t* grp = block + g * F::GROUP_BYTES;
      each_slice<F>(&grp, _mm512_setzero_si512(), [&](int j, auto unpack) {
        const __m512i u = unpack(0);  // code + offset
        const __m512i v_even = _mm512_sub_epi16(_mm512_maddubs_epi16(u, sc_even), offset);
        const __m512i v_odd = _mm512_sub_epi16(_mm512_maddubs_epi16(u, sc_odd), offset);
        // lo: the low bytes of both in their places; hi: the high bytes (arithmetic shift)
        const __m512i low = _mm512_ternarylogic_epi32(v_even, _mm512_slli_epi16(v_odd, 8), even, 0xEC);
        const __m512i high = _mm512_ternarylogic_epi32(_mm512_srai_epi16(v_even, 8), v_odd, even, 0xE4);
        _mm512_store_si512(lo + 64 * j, low);
        _mm512_store_si512(lo + 1024 + 64 * j, high);
      });
    }
  }
}

// a per-thread buffer for one column tile's weight tiles (kept between calls, as amx.h's)
static uint8_t* q6k_tile_buffer(int64_t k) {
  thread_local std::vector<uint8_t> buffer;
  const size_t need = (size_t)(k / 64) * Q6K_STEP_BYTES + 64;
  if (buffer.size() < need) buffer.resize(need);
  return reinterpret_cast<uint8_t*>(((uintptr_t)buffer.data() + 63) & ~(uintptr_t)63);
}

// R rows (of the min(m, 16) the tiles multiply) at r0 of a decoded column tile `weights`; each
// super-block's sums folded while the next one multiplies. (Asking for the next tile's packed
// bytes here, to overlap its stream with the tiles' work, made 16 rows 1.15-1.4x slower.)
template <int R>
static void q6k_rows_amx(const Acts& a, int64_t r0, const uint8_t* weights, const uint8_t* packed_tile,
                         __m512 (&out)[R][1]) {
  const int64_t blocks = a.k / 256, bytes = Q6K::block_bytes(false);
  const int8_t* x = a.xq + r0 * a.k;
  alignas(64) int32_t sums[2][2][16 * 16];  // [buffer][lo, hi]
  __m512 acc[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
  auto multiply = [&](int64_t b, int buffer) {
    const uint8_t* w = weights + b * 4 * Q6K_STEP_BYTES;
    const int8_t* xb = x + b * 256;
    _tile_zero(0);
    _tile_zero(1);
    TILE_LOAD(2, xb, a.k);
    TILE_LOAD(4, w, 64);
    TILE_LOAD(5, w + 1024, 64);
    _tile_dpbsud(0, 2, 4);
    _tile_dpbssd(1, 2, 5);
    TILE_LOAD(3, xb + 64, a.k);
    TILE_LOAD(6, w + Q6K_STEP_BYTES, 64);
    TILE_LOAD(7, w + Q6K_STEP_BYTES + 1024, 64);
    _tile_dpbsud(0, 3, 6);
    _tile_dpbssd(1, 3, 7);
    TILE_LOAD(2, xb + 128, a.k);
    TILE_LOAD(4, w + 2 * Q6K_STEP_BYTES, 64);
    TILE_LOAD(5, w + 2 * Q6K_STEP_BYTES + 1024, 64);
    _tile_dpbsud(0, 2, 4);
    _tile_dpbssd(1, 2, 5);
    TILE_LOAD(3, xb + 192, a.k);
    TILE_LOAD(6, w + 3 * Q6K_STEP_BYTES, 64);
    TILE_LOAD(7, w + 3 * Q6K_STEP_BYTES + 1024, 64);
    _tile_dpbsud(0, 3, 6);
    _tile_dpbssd(1, 3, 7);
    _tile_stored(0, sums[buffer][0], 64);
    _tile_stored(1, sums[buffer][1], 64);
  };
  auto fold = [&](int64_t b, int buffer) {
    const uint8_t* block = packed_tile + b * bytes;
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) {
      const __m512i s = _mm512_add_epi32(_mm512_load_si512(sums[buffer][0] + 16 * r),
                                         _mm512_slli_epi32(_mm512_load_si512(sums[buffer][1] + 16 * r), 8));
      acc[r] = fold_q6k<Q6K>(block, s, a.dx[(r0 + r) * blocks + b], acc[r]);
    }
  };
  for (int64_t b = 0; b < blocks; b++) {
    multiply(b, b % 2);
    if (b > 0) fold(b - 1, (b - 1) % 2);
  }
  fold(blocks - 1, (blocks - 1) % 2);
#pragma GCC unroll 16
  for (int r = 0; r < R; r++) out[r][0] = acc[r];
}

// columns_vnni's contract for Q6K on the tiles: column tiles t0..t1 of y for all m rows, in
// blocks of 16 rows (the last block the rest; a.xq holds whole blocks of 16 rows)
static void q6k_columns_amx(const Acts& a, int64_t m, const uint8_t* packed, const float* residual,
                            float* y, int64_t n, int64_t t0, int64_t t1) {
  const int64_t tile_bytes = a.k / 256 * Q6K::block_bytes(false), full = m / 16 * 16;
  uint8_t* weights = q6k_tile_buffer(a.k);
  k_amx::configure_tiles(m, 64);
  auto block = [&](int rows, int64_t r0, int64_t t) {
#define Q6K_AMX_ROWS_CASE(R)                                              \
  case R: {                                                               \
    __m512 acc[R][1];                                                     \
    q6k_rows_amx<R>(a, r0, weights, packed + t * tile_bytes, acc);        \
    k_avx512::store_tiles<R, 1>(acc, R, r0, t, n, residual, y);           \
    break;                                                                \
  }
    switch (rows) { EVERY_TILE_ROW_COUNT(Q6K_AMX_ROWS_CASE) }
#undef Q6K_AMX_ROWS_CASE
  };
  for (int64_t t = t0; t < t1; t++) {
    decode_q6k_tile(packed + t * tile_bytes, a.k, weights);
    for (int64_t r0 = 0; r0 < full; r0 += 16) block(16, r0, t);
    if (m > full) block((int)(m - full), full, t);
  }
  _tile_release();  // the tile state back to its initial (small) form for context switches
}
#undef TILE_LOAD             // (amx.h's)
#undef EVERY_TILE_ROW_COUNT  // (amx.h's)
#pragma GCC pop_options

template <class F, bool MIN>
static void columns(int64_t isa, bool decoded, const Acts& a, const q8blocks::Acts& a8, int64_t m,
                    const uint8_t* packed, const float* residual, float* y, int64_t n,
                    int64_t t0, int64_t t1) {
  if constexpr (F::SUPER) {
    if constexpr (is_q6k<F>)
      if (tiles_pay(m, isa, Q6K_AMX_MIN_ROWS)) return q6k_columns_amx(a, m, packed, residual, y, n, t0, t1);
    if constexpr (F::G == 16)  // (Q4K's and Q5K's groups of 32 have no decoded tiles)
      if (a.xu) return q6k_columns_decoded_avx2<F>(a, m, packed, residual, y, n, t0, t1);
  }
  if constexpr (std::is_same_v<F, FiveBit>)
    if (decoded) return columns_decoded<F, MIN>(a8, m, packed, residual, y, n, t0, t1);
  if (isa >= AVX512) return columns_vnni<F, MIN>(a, m, packed, residual, y, n, t0, t1);
  if constexpr (F::CODEBOOK) {  // block int8's AVX2 kernel, reading the indices
    // (IQ4XS on AVX2 alone: the portable kernel. The loader holds IQ4_XS so only on VNNI CPUs,
    // and VPMADDUBSW's unsigned operand would not take its signed codes)
    if constexpr (!F::SUPER)
      if (isa >= AVX2)
        return q8blocks::columns_avx2<F::G, false, !F::FLOAT32>(a8, m, packed, residual, y, n, t0,
                                                                 t1, CodebookCodes{a.codebook});
  } else if (isa >= AVX2) {
    return columns_avx2<F, MIN>(a, m, packed, residual, y, n, t0, t1);
  }
  columns_generic<F, MIN>(a, m, packed, residual, y, n, t0, t1);
}

// the layouts as small_codes_linear's `layout` names them (kernels.SMALL_CODES_LAYOUTS)
enum Layout : int64_t {
  Q6K_LAYOUT = 0, FIVE_BIT_LAYOUT = 1, FIVE_BIT32_LAYOUT = 2, CODEBOOK_LAYOUT = 3, CODEBOOK32_LAYOUT = 4,
  Q3K_LAYOUT = 5, Q2K_LAYOUT = 6, CODEBOOK16_LAYOUT = 7, Q4K_LAYOUT = 8, Q5K_LAYOUT = 9,
  IQ4XS_LAYOUT = 10
};

}  // namespace small_codes

// y [m, n] = x [m, k] times small-code weights (+ residual [m, n]) in `layout`: Q6K packed
// [N / 16, K / 256, 3392], FIVE_BIT [N / 16, K / 32, 352 or 384 with `minimum`], CODEBOOK [N /
// 16, K / 32, 288] (CODEBOOK32: 320; CODEBOOK16: [N / 16, K / 16, 192]), Q3K [N / 16, K / 256,
// 2368], Q2K [N / 16, K / 256, 1344], Q4K [N / 16, K / 256, 2368], Q5K [N / 16, K / 256, 2880],
// IQ4XS [N / 16, K / 256, 2240] (Q2K's, Q4K's and Q5K's minimums are the layout's: `minimum`
// true). `input_scale` (Q6K, Q3K, Q2K, Q4K, Q5K, IQ4XS): y times it, as the
// activations' scales dx times it (a query scale folded into a projection whose float16
// super-block scales cannot take it: models/int8_blocks.py's input_scale), of the first
// `scaled_columns` columns (a multiple of 16: a scaled q fused with its k; -1: all of them).
// `codebook` (CODEBOOK layouts and IQ4XS alone): int8 [16], the codes their 4-bit indices name
// (a GGUF I-quant's values)
at::Tensor small_codes_linear(const at::Tensor& x, const at::Tensor& packed, int64_t layout,
                              bool minimum, const c10::optional<at::Tensor>& residual, int64_t n,
                              int64_t isa, double input_scale,
                              const c10::optional<at::Tensor>& codebook, int64_t scaled_columns) {
  using namespace small_codes;
  TORCH_CHECK(layout >= Q6K_LAYOUT && layout <= IQ4XS_LAYOUT,
              "small-code layouts: 0 (Q6_K), 1 (five-bit codes), 2 (five-bit codes, float32 "
              "scales), 3 (codebook indices), 4 (codebook indices, float32 scales), 5 (Q3_K), 6 "
              "(Q2_K), 7 (codebook indices, float32 scales per 16 inputs), 8 (Q4_K), 9 (Q5_K) "
              "or 10 (IQ4_XS), not ", layout);
  const bool q6k = layout == Q6K_LAYOUT, f32 = layout == FIVE_BIT32_LAYOUT;
  const bool book16 = layout == CODEBOOK16_LAYOUT, q3k = layout == Q3K_LAYOUT;
  const bool iq4xs = layout == IQ4XS_LAYOUT;
  const bool book = layout == CODEBOOK_LAYOUT || layout == CODEBOOK32_LAYOUT || book16 || iq4xs;
  const bool q2k = layout == Q2K_LAYOUT, q4k = layout == Q4K_LAYOUT, q5k = layout == Q5K_LAYOUT;
  const bool mins = q2k || q4k || q5k;  // minimums folded in integers: each group's sum(xq) wanted
  // activations per 256 inputs, sub-block scales in integers
  const bool super = q6k || q3k || mins || iq4xs;
  TORCH_CHECK(!(q6k || q3k || book) || !minimum, "the Q6_K, Q3_K and codebook layouts have no minimums");
  TORCH_CHECK(!mins || minimum, "the Q2_K, Q4_K and Q5_K layouts have minimums");
  TORCH_CHECK(input_scale == 1.0 || super,
              "only the Q6_K, Q3_K, Q2_K, Q4_K, Q5_K and IQ4_XS layouts take an input scale");
  TORCH_CHECK(book == codebook.has_value(), "the codebook layouts, and they alone, take a codebook");
  TORCH_CHECK(!book || (codebook->scalar_type() == at::kChar && codebook->dim() == 1 &&
                       codebook->numel() == 16 && codebook->is_contiguous()),
              "a codebook is sixteen int8 codes, got ", book ? codebook->sizes() : packed.sizes());
  const int64_t bytes = q6k ? Q6K::block_bytes(false)
                        : q3k ? Q3K::block_bytes(false)
                        : q2k ? Q2K::block_bytes(false)
                        : q4k ? Q4K::block_bytes(false)
                        : q5k ? Q5K::block_bytes(false)
                        : iq4xs ? IQ4XS::block_bytes(false)
                        : f32 ? FiveBit32::block_bytes(minimum)
                        : layout == CODEBOOK_LAYOUT ? Codebook::block_bytes(false)
                        : layout == CODEBOOK32_LAYOUT ? Codebook32::block_bytes(false)
                        : book16 ? Codebook16::block_bytes(false)
                        : FiveBit::block_bytes(minimum);
  const int64_t inputs = super ? 256 : book16 ? 16 : 32;
  const int64_t group = (super && !q4k && !q5k && !iq4xs) || book16 ? 16 : 32;
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == bytes && packed.scalar_type() == at::kByte &&
              packed.is_contiguous(), "small-code weights (layout ", layout, ") must be packed uint8 [N / 16, K / ",
              inputs, ", ", bytes, "], got ", packed.sizes());
  const int64_t tiles = packed.size(0), k = packed.size(1) * inputs, m = x.size(0);
  check_rows(x, k, "small-code linear input");
  TORCH_CHECK(tiles * 16 >= n && tiles * 16 < n + 16, "packed weights hold ", tiles * 16,
              " columns, not ", n);
  const float* res = residual_ptr(residual, m, n);
  TORCH_CHECK(scaled_columns == -1 || (scaled_columns >= 0 && scaled_columns % 16 == 0 && scaled_columns <= n),
              "scaled columns are -1 (all) or whole tiles of 16 of the ", n, ", not ", scaled_columns);
  // the column tiles whose activations' scales are times input_scale: all, or the first ones,
  // which read dx_scaled
  const int64_t scaled_tiles = scaled_columns == -1 ? tiles : scaled_columns / 16;
  // FIVE_BIT with more rows than a pass of the direct kernel: tiles decoded once to block int8's
  // layout; Q6K with rows enough: the AMX tiles, which read whole blocks of 16 rows, or on AVX2
  // tiles decoded once, which read the activations plus 128 and no offset terms
  const bool amx = q6k && tiles_pay(m, isa, Q6K_AMX_MIN_ROWS);
  const bool decoded = layout == FIVE_BIT_LAYOUT && isa >= AVX512 && m >= SMALL_CODES_DECODE_MIN_ROWS;
  // (on AVX2 alone: AVX-512 CPUs take their VNNI kernels)
  const bool q6k_decoded = (q6k || q3k || q2k) && !amx && isa == AVX2 &&
                           m >= (q6k ? Q6K_AVX2_DECODE_MIN_ROWS
                                 : q3k ? Q3K_AVX2_DECODE_MIN_ROWS : Q2K_AVX2_DECODE_MIN_ROWS);
  // (a codebook's VNNI kernels read code + 128, its AVX2 and portable ones the code)
  const int32_t code_offset = q6k ? offset<Q6K>(false) : q3k ? offset<Q3K>(false)
                              : book ? (isa >= AVX512 ? 128 : 0)
                              : offset<FiveBit>(minimum);
  std::vector<int8_t> xq((amx ? (m + 15) / 16 * 16 : m) * k);
  std::vector<float> dx(m * (k / (super ? 256 : 32))), sx(super ? 0 : m * (k / 32));
  std::vector<float> dx_scaled(input_scale != 1.0 && scaled_tiles < tiles ? dx.size() : 0);
  // each group's offset term (none without a code offset: the minimums layouts', decoded Q6K's)
  const bool biased = !mins && !q6k_decoded;
  std::vector<int32_t> bias(biased ? m * (k / group) : 0);
  std::vector<int16_t> xsum(mins ? m * (k / group) : 0);
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, m, 8, [&](int64_t r0, int64_t r1) {  // rows: one quantisation each
    if (super) quantise_rows_isa<256>(xp, r0, r1, k, xq.data(), dx.data(), nullptr, isa);
    else quantise_rows_isa(xp, r0, r1, k, xq.data(), dx.data(), sx.data(), isa);
    if (input_scale != 1.0)
      for (int64_t i = r0 * (k / 256); i < r1 * (k / 256); i++)
        (dx_scaled.empty() ? dx[i] : dx_scaled[i]) = dx[i] * static_cast<float>(input_scale);
    if (!biased && !mins) return;  // (neither offset terms nor sums wanted)
    for (int64_t r = r0; r < r1; r++)
      for (int64_t g = 0; g < k / group; g++) {
        int32_t total = 0;
        for (int64_t i = 0; i < group; i++) total += xq[r * k + g * group + i];
        if (biased) bias[r * (k / group) + g] = -code_offset * total;
        if (mins) xsum[r * (k / group) + g] = static_cast<int16_t>(total);
      }
  });
  std::vector<uint8_t> xu(q6k_decoded ? m * k : 0);
  if (q6k_decoded) q6k_interleave(xq.data(), m, k, xu.data());
  const Acts acts{xq.data(), dx.data(), bias.data(), sx.data(), k, q6k_decoded ? xu.data() : nullptr,
                  xsum.data(), book ? codebook->data_ptr<int8_t>() : nullptr};
  Acts scaled_acts = acts;
  if (!dx_scaled.empty()) scaled_acts.dx = dx_scaled.data();
  const q8blocks::Acts acts8{xq.data(), dx.data(), bias.data(), sx.data(), k};
  auto y = at::empty({m, n}, x.options());
  float* yp = y.data_ptr<float>();
  const uint8_t* w = packed.data_ptr<uint8_t>();
  auto run = [&](const Acts& acts, int64_t t0, int64_t t1) {
    if (t0 >= t1) return;
    if (q6k) columns<Q6K, false>(isa, decoded, acts, acts8, m, w, res, yp, n, t0, t1);
    else if (q3k) columns<Q3K, false>(isa, decoded, acts, acts8, m, w, res, yp, n, t0, t1);
    else if (q2k) columns<Q2K, false>(isa, decoded, acts, acts8, m, w, res, yp, n, t0, t1);
    else if (q4k) columns<Q4K, false>(isa, decoded, acts, acts8, m, w, res, yp, n, t0, t1);
    else if (q5k) columns<Q5K, false>(isa, decoded, acts, acts8, m, w, res, yp, n, t0, t1);
    else if (iq4xs) columns<IQ4XS, false>(isa, decoded, acts, acts8, m, w, res, yp, n, t0, t1);
    else if (layout == CODEBOOK_LAYOUT) columns<Codebook, false>(isa, decoded, acts, acts8, m, w, res, yp, n, t0, t1);
    else if (layout == CODEBOOK32_LAYOUT) columns<Codebook32, false>(isa, decoded, acts, acts8, m, w, res, yp, n, t0, t1);
    else if (book16) columns<Codebook16, false>(isa, decoded, acts, acts8, m, w, res, yp, n, t0, t1);
    else if (f32 && minimum) columns<FiveBit32, true>(isa, decoded, acts, acts8, m, w, res, yp, n, t0, t1);
    else if (f32) columns<FiveBit32, false>(isa, decoded, acts, acts8, m, w, res, yp, n, t0, t1);
    else if (minimum) columns<FiveBit, true>(isa, decoded, acts, acts8, m, w, res, yp, n, t0, t1);
    else columns<FiveBit, false>(isa, decoded, acts, acts8, m, w, res, yp, n, t0, t1);
  };
  at::parallel_for(0, tiles, tile_grain(tiles), [&](int64_t t0, int64_t t1) {
    run(scaled_acts, t0, std::min(t1, scaled_tiles));
    run(acts, std::max(t0, scaled_tiles), t1);
  });
  return y;
}
