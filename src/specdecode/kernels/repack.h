// Loading a GGUF file: its blocks decoded and moved into the kernels' layouts, in C++ (included
// by cpu_kernels.cpp). Each function is a byte shuffle or a conversion of the file's numbers
// with the float32 operations ggml's dequantisation performs, so its output is the same bytes
// that the layouts' Python docstrings describe (kernels/__init__.py, models/int8_blocks.py,
// models/gguf_reader.py); numpy did the same at about a tenth of the speed: most of the seconds
// a 1.5B model took to load. Threads split blocks or tiles.

#include <string>

namespace repack {

static inline float half_to_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));  // exact, inf and NaN too
}

static inline uint16_t half_bits(float v) { return c10::Half(v).x; }  // rounded to nearest even

// ggml's get_scale_min_k4: Q4_K/Q5_K's 12 scale bytes -> sub-block j's 6-bit scale and minimum
static inline void scale_min_k4(const uint8_t* s, int j, int* sc, int* mn) {
  if (j < 4) {
    *sc = s[j] & 63;
    *mn = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
    *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// ggml-common.h's kvalues_mxfp4: an e2m1 code's value doubled
static const int8_t MXFP4_VALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

enum Kind { Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, MXFP4 };

struct BlockType {
  Kind kind;
  int64_t bytes, weights, group;
  bool minimum;
};

static BlockType block_type(const std::string& qtype) {
  static const std::map<std::string, BlockType> types = {
      {"Q8_0", {Q8_0, 34, 32, 32, false}},   {"Q4_0", {Q4_0, 18, 32, 32, false}},
      {"Q4_1", {Q4_1, 20, 32, 32, true}},    {"Q5_0", {Q5_0, 22, 32, 32, false}},
      {"Q5_1", {Q5_1, 24, 32, 32, true}},    {"Q4_K", {Q4_K, 144, 256, 32, true}},
      {"Q5_K", {Q5_K, 176, 256, 32, true}},  {"Q6_K", {Q6_K, 210, 256, 16, false}},
      {"MXFP4", {MXFP4, 17, 32, 32, false}}};
  const auto found = types.find(qtype);
  TORCH_CHECK(found != types.end(), "no block int8 decoding of GGUF type ", qtype);
  return found->second;
}

// One block of `qtype` -> its codes, scales and (where the type has them) minimums, as
// int8_blocks.py's table gives them.
static void decode_block(Kind kind, const uint8_t* b, int8_t* codes, float* scale, float* minimum) {
  if (kind == Q8_0) {
    scale[0] = half_to_float(b);
    std::memcpy(codes, b + 2, 32);
  } else if (kind == Q4_0 || kind == Q4_1 || kind == Q5_0 || kind == Q5_1) {
    const bool with_min = kind == Q4_1 || kind == Q5_1, five = kind == Q5_0 || kind == Q5_1;
    scale[0] = half_to_float(b);
    if (with_min) minimum[0] = half_to_float(b + 2);
    const uint8_t* at = b + (with_min ? 4 : 2);
    uint32_t high = 0;  // Q5: bit i is input i's fifth bit
    if (five) std::memcpy(&high, at, 4);
    const uint8_t* qs = at + (five ? 4 : 0);
    const int offset = with_min ? 0 : (five ? 16 : 8);  // Q4_0/Q5_0: w = d (q - offset)
    for (int i = 0; i < 32; i++) {
      int q = i < 16 ? (qs[i] & 15) : (qs[i - 16] >> 4);
      if (five) q |= ((high >> i) & 1) << 4;
      codes[i] = static_cast<int8_t>(q - offset);
    }
  } else if (kind == Q4_K || kind == Q5_K) {
    const float d = half_to_float(b), dmin = half_to_float(b + 2);
    const uint8_t* qh = b + 16;  // Q5_K: sub-block s's fifth bit of input i is bit s of qh[i]
    const uint8_t* qs = b + (kind == Q5_K ? 48 : 16);
    for (int s = 0; s < 8; s++) {
      int sc, mn;
      scale_min_k4(b + 4, s, &sc, &mn);
      scale[s] = d * static_cast<float>(sc);
      minimum[s] = -(dmin * static_cast<float>(mn));
      // sub-block 2j: the low nibbles of bytes 32j..32j+31, 2j + 1: their high nibbles
      const uint8_t* q = qs + 32 * (s / 2);
      for (int i = 0; i < 32; i++) {
        int code = (s % 2 ? q[i] >> 4 : q[i] & 15);
        if (kind == Q5_K) code |= ((qh[i] >> s) & 1) << 4;
        codes[32 * s + i] = static_cast<int8_t>(code);
      }
    }
  } else if (kind == Q6_K) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = half_to_float(b + 208);
    for (int g = 0; g < 16; g++) scale[g] = d * static_cast<float>(sc[g]);
    // each half of 128 weights: 64 bytes of low nibbles (weights 0..63 low, 64..127 high) and
    // 32 bytes of 2-bit high parts (weights 32 s + i in bits 2 s of byte i)
    for (int h = 0; h < 2; h++)
      for (int r = 0; r < 128; r++) {
        const int low = (ql[64 * h + r % 64] >> (4 * (r / 64))) & 15;
        const int top = (qh[32 * h + r % 32] >> (2 * (r / 32))) & 3;
        codes[128 * h + r] = static_cast<int8_t>((low | (top << 4)) - 32);
      }
  } else {  // MXFP4: the exponent byte, then 16 bytes of codes laid out as Q4_0's
    const uint32_t e = b[0];
    // 2^(e - 128) from its bits (ggml's e8m0_to_fp32_half): a subnormal below e = 2
    const uint32_t bits = e < 2 ? (0x00200000u << e) : ((e - 1) << 23);
    std::memcpy(scale, &bits, 4);
    for (int i = 0; i < 32; i++) codes[i] = MXFP4_VALUES[i < 16 ? (b[1 + i] & 15) : (b[1 + i - 16] >> 4)];
  }
}

// GGUF blocks uint8 [blocks, bytes of one] of `qtype` -> (codes int8 [blocks, weights of one],
// scales float32 [blocks, groups of one], minimums likewise or an empty tensor)
std::vector<at::Tensor> decode_blocks(const at::Tensor& raw, const std::string& qtype) {
  const BlockType t = block_type(qtype);
  TORCH_CHECK(raw.scalar_type() == at::kByte && raw.is_contiguous() && raw.dim() == 2 &&
                  raw.size(1) == t.bytes,
              "decode_blocks: contiguous uint8 [blocks, ", t.bytes, "] of ", qtype);
  const int64_t n = raw.size(0), groups = t.weights / t.group;
  at::Tensor codes = at::empty({n, t.weights}, at::kChar);
  at::Tensor scale = at::empty({n, groups}, at::kFloat);
  at::Tensor minimum = t.minimum ? at::empty({n, groups}, at::kFloat) : at::empty({0}, at::kFloat);
  const uint8_t* src = raw.data_ptr<uint8_t>();
  int8_t* c = codes.data_ptr<int8_t>();
  float *s = scale.data_ptr<float>(), *m = minimum.data_ptr<float>();
  at::parallel_for(0, n, 1024, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; b++)
      decode_block(t.kind, src + b * t.bytes, c + b * t.weights, s + b * groups,
                   t.minimum ? m + b * groups : nullptr);
  });
  return {codes, scale, minimum};
}

// Q4_0, Q4_1 or Q4_K data uint8 [rows, bytes] -> (nibbles uint8 [rows, groups, 16], scale and
// minimum float16 [rows, groups]): byte k of a group holds its weight k in the low nibble and
// k + 16 in the high one (Q4_0's layout); Q4_0's minimum -8 d, Q4_K's scale d * sc and minimum
// -(dmin * m) rounded to float16 (gguf_reader.Q4Blocks).
std::vector<at::Tensor> q4_nibbles(const at::Tensor& raw, const std::string& qtype) {
  TORCH_CHECK(qtype == "Q4_0" || qtype == "Q4_1" || qtype == "Q4_K", "q4_nibbles: not ", qtype);
  const BlockType t = block_type(qtype);
  TORCH_CHECK(raw.scalar_type() == at::kByte && raw.is_contiguous() && raw.dim() == 2 &&
                  raw.size(1) % t.bytes == 0,
              "q4_nibbles: contiguous uint8 [rows, a multiple of ", t.bytes, "] of ", qtype);
  const int64_t rows = raw.size(0), blocks = raw.size(1) / t.bytes, per_block = t.weights / 32;
  const int64_t groups = blocks * per_block;
  at::Tensor nibbles = at::empty({rows, groups, 16}, at::kByte);
  at::Tensor scale = at::empty({rows, groups}, at::kHalf), minimum = at::empty({rows, groups}, at::kHalf);
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* out = nibbles.data_ptr<uint8_t>();
  uint16_t* s = reinterpret_cast<uint16_t*>(scale.data_ptr<at::Half>());
  uint16_t* m = reinterpret_cast<uint16_t*>(minimum.data_ptr<at::Half>());
  at::parallel_for(0, rows * blocks, 256, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; b++) {
      const uint8_t* block = src + b * t.bytes;
      uint8_t* nib = out + b * per_block * 16;
      uint16_t *bs = s + b * per_block, *bm = m + b * per_block;
      if (t.kind != Q4_K) {
        std::memcpy(nib, block + (t.kind == Q4_1 ? 4 : 2), 16);
        std::memcpy(bs, block, 2);
        if (t.kind == Q4_1) std::memcpy(bm, block + 2, 2);
        else bm[0] = half_bits(-8.0f * half_to_float(block));  // exact in float16, as in float32
        continue;
      }
      const float d = half_to_float(block), dmin = half_to_float(block + 2);
      for (int j = 0; j < 4; j++) {
        // sub-block 2j: the low nibbles of bytes 32j..32j+31; 2j + 1: their high nibbles
        const uint8_t *a = block + 16 + 32 * j, *z = a + 16;
        for (int k = 0; k < 16; k++) {
          nib[(2 * j) * 16 + k] = static_cast<uint8_t>((a[k] & 15) | (z[k] << 4));
          nib[(2 * j + 1) * 16 + k] = static_cast<uint8_t>((a[k] >> 4) | (z[k] & 0xF0));
        }
      }
      for (int g = 0; g < 8; g++) {
        int sc, mn;
        scale_min_k4(block + 4, g, &sc, &mn);
        bs[g] = half_bits(d * static_cast<float>(sc));  // float32 products, as ggml's, rounded
        bm[g] = half_bits(-(dmin * static_cast<float>(mn)));
      }
    }
  });
  return {nibbles, scale, minimum};
}

// fill(block, row, g, c) for column c (row `row` of the matrix) of every packed block: tile t
// and group g's `bytes` bytes at out + (t * groups + g) * bytes; threads split the tiles
template <class Fill>
static void each_column_of_blocks(uint8_t* out, int64_t tiles, int64_t groups, int64_t bytes,
                                  Fill&& fill) {
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; t++)
      for (int64_t g = 0; g < groups; g++)
        for (int c = 0; c < 16; c++) fill(out + (t * groups + g) * bytes, t * 16 + c, g, c);
  });
}

// gguf_reader.Q4Blocks -> kernels.pack_q4's layout written into `out` uint8 [tiles, groups,
// 320]: the group's 16 bytes of column c as bytes 4c + 64j .. of its 4 slices j (word j of the
// group), then the tile's 16 scales and 16 minimums; rows past the last padded with zeros.
void pack_q4_blocks(const at::Tensor& nibbles, const at::Tensor& scale, const at::Tensor& minimum,
                    at::Tensor out) {
  TORCH_CHECK(nibbles.scalar_type() == at::kByte && nibbles.dim() == 3 && nibbles.size(2) == 16 &&
                  nibbles.is_contiguous(),
              "pack_q4_blocks: contiguous nibbles uint8 [rows, groups, 16]");
  const int64_t rows = nibbles.size(0), groups = nibbles.size(1), tiles = (rows + 15) / 16;
  for (const at::Tensor* t : {&scale, &minimum})
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->size(0) == rows &&
                    t->size(1) == groups,
                "pack_q4_blocks: contiguous float16 scales and minimums [rows, groups]");
  TORCH_CHECK(out.scalar_type() == at::kByte && out.is_contiguous() && out.size(0) == tiles &&
                  out.size(1) == groups && out.size(2) == Q4_BLOCK,
              "pack_q4_blocks: out must be contiguous uint8 [", tiles, ", ", groups, ", 320]");
  const uint8_t* nib = nibbles.data_ptr<uint8_t>();
  const uint8_t* sc = reinterpret_cast<const uint8_t*>(scale.data_ptr<at::Half>());
  const uint8_t* mn = reinterpret_cast<const uint8_t*>(minimum.data_ptr<at::Half>());
  each_column_of_blocks(out.data_ptr<uint8_t>(), tiles, groups, Q4_BLOCK,
                        [&](uint8_t* block, int64_t row, int64_t g, int c) {
    if (row >= rows) {
      for (int j = 0; j < 4; j++) std::memset(block + 64 * j + 4 * c, 0, 4);
      std::memset(block + 256 + 2 * c, 0, 2);
      std::memset(block + 288 + 2 * c, 0, 2);
      return;
    }
    const uint8_t* from = nib + (row * groups + g) * 16;
    for (int j = 0; j < 4; j++) std::memcpy(block + 64 * j + 4 * c, from + 4 * j, 4);
    std::memcpy(block + 256 + 2 * c, sc + (row * groups + g) * 2, 2);
    std::memcpy(block + 288 + 2 * c, mn + (row * groups + g) * 2, 2);
  });
}

// GGUF Q6_K weights (codes int8 [N, K] in -32..31, sc int8 [N, K / 16], d float16 [N, K / 256])
// -> kernels.pack_q6k's layout uint8 [N / 16, K / 256, 3392] (see its docstring); rows past
// the last are code 0 (u = 32), sc 0 and d 0.
at::Tensor pack_q6k(const at::Tensor& codes, const at::Tensor& sub_scale, const at::Tensor& super_scale) {
  const int64_t n = codes.size(0), k = codes.size(1), supers = k / 256, tiles = (n + 15) / 16;
  TORCH_CHECK(codes.scalar_type() == at::kChar && sub_scale.scalar_type() == at::kChar &&
                  super_scale.scalar_type() == at::kHalf && codes.is_contiguous() &&
                  sub_scale.is_contiguous() && super_scale.is_contiguous(),
              "pack_q6k: contiguous codes and sc int8, d float16");
  at::Tensor packed = at::zeros({tiles, supers, small_codes::Q6K::block_bytes(false)}, at::kByte);
  const int8_t *q = codes.data_ptr<int8_t>(), *sc = sub_scale.data_ptr<int8_t>();
  const uint8_t* d = reinterpret_cast<const uint8_t*>(super_scale.data_ptr<at::Half>());
  each_column_of_blocks(packed.data_ptr<uint8_t>(), tiles, supers, small_codes::Q6K::block_bytes(false),
                        [&](uint8_t* block, int64_t row, int64_t s, int c) {
    const bool real = row < n;
    for (int g = 0; g < 16; g++) {
      uint8_t* group = block + 192 * g;
      for (int i = 0; i < 4; i++) {
        uint8_t u[4];  // slice j's byte 4c + i: input 16 g + 4 j + i, as code + 32
        for (int j = 0; j < 4; j++)
          u[j] = static_cast<uint8_t>(32 + (real ? q[row * k + 256 * s + 16 * g + 4 * j + i] : 0));
        const int at = 4 * c + i;
        group[at] = static_cast<uint8_t>((u[0] & 15) | ((u[1] & 15) << 4));
        group[64 + at] = static_cast<uint8_t>((u[2] & 15) | ((u[3] & 15) << 4));
        group[128 + at] = static_cast<uint8_t>((u[0] >> 4) | ((u[1] >> 4) << 2) |
                                               ((u[2] >> 4) << 4) | ((u[3] >> 4) << 6));
      }
      block[3072 + 16 * g + c] = real ? static_cast<uint8_t>(sc[row * (k / 16) + 16 * s + g]) : 0;
    }
    if (real) std::memcpy(block + 3328 + 2 * c, d + (row * supers + s) * 2, 2);
  });
  return packed;
}

// Weights of codes that fit in 5 bits (int8 [N, K]; -16..15 without minimums, 0..31 with) with
// float16 or float32 scales (and minimums, the same type) [N, K / 32] -> kernels.pack_five_bit's
// layout uint8 [N / 16, K / 32, 320 + 16 x the scale's bytes x (1 or 2)] (see its docstring);
// rows past the last are zero bytes.
at::Tensor pack_five_bit(const at::Tensor& codes, const at::Tensor& scale,
                         const c10::optional<at::Tensor>& minimum) {
  const int64_t n = codes.size(0), k = codes.size(1), groups = k / 32, tiles = (n + 15) / 16;
  const bool with_min = minimum.has_value();
  const auto type = scale.scalar_type();
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.is_contiguous() &&
                  (type == at::kHalf || type == at::kFloat) && scale.is_contiguous() &&
                  (!with_min || (minimum->scalar_type() == type && minimum->is_contiguous())),
              "pack_five_bit: contiguous codes int8, scales and minimums both float16 or float32");
  const int64_t size = scale.element_size(), width = 320 + 16 * size * (with_min ? 2 : 1);
  at::Tensor packed = at::zeros({tiles, groups, width}, at::kByte);
  const int8_t* q = codes.data_ptr<int8_t>();
  const uint8_t* sc = reinterpret_cast<const uint8_t*>(scale.data_ptr());
  const uint8_t* mn = with_min ? reinterpret_cast<const uint8_t*>(minimum->data_ptr()) : nullptr;
  const int offset = with_min ? 0 : 16;
  each_column_of_blocks(packed.data_ptr<uint8_t>(), tiles, groups, width,
                        [&](uint8_t* block, int64_t row, int64_t g, int c) {
    const bool real = row < n;
    for (int i = 0; i < 4; i++) {
      uint8_t u[8];  // slice j's byte 4c + i: input 4 j + i, as code + offset
      uint8_t top = 0;
      for (int j = 0; j < 8; j++) {
        u[j] = real ? static_cast<uint8_t>(offset + q[row * k + 32 * g + 4 * j + i]) : 0;
        top |= static_cast<uint8_t>((u[j] >> 4) << j);
      }
      const int at = 4 * c + i;
      for (int p = 0; p < 4; p++)
        block[64 * p + at] = static_cast<uint8_t>((u[2 * p] & 15) | ((u[2 * p + 1] & 15) << 4));
      block[256 + at] = top;
    }
    if (!real) return;
    std::memcpy(block + 320 + size * c, sc + (row * groups + g) * size, size);
    if (with_min) std::memcpy(block + 320 + 16 * size + size * c, mn + (row * groups + g) * size, size);
  });
  return packed;
}

}  // namespace repack
