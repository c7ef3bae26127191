// Micro-kernels of the benchmark's roofline (bench/roofline.py), kept out of the runner's
// extension: nothing here runs when generating. Python calls them only where the CPU has
// AVX-512 VNNI (kernels.isa() >= avx512); this file is compiled with those instructions.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <chrono>
#include <vector>

// VPDPBUSD and nothing else, in twelve independent chains: the int8 multiply-add peak of a
// core, the roofline the bench sets the Q4 kernel against
static int64_t vnni_chains(int64_t iterations) {
  __m512i acc[12];
  for (int i = 0; i < 12; i++) acc[i] = _mm512_set1_epi32(i);
  __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(1);
  for (int64_t it = 0; it < iterations; it++) {
    for (int i = 0; i < 12; i++) acc[i] = _mm512_dpbusd_epi32(acc[i], a, b);
    __asm__ volatile("" : "+v"(a));  // keeps the loop from being folded into a product
  }
  int64_t total = 0;
  for (int i = 0; i < 12; i++) total += _mm512_reduce_add_epi32(acc[i]);
  return total;
}

// q4_tiles_vnni<4, 2>'s instructions for one group, on registers only: 64 VPDPBUSD with the
// nibble unpacking (8 shifts, 16 ands), the float16 scales' conversion (4) and the fold (8
// int-to-float conversions, 8 multiplies, 16 fmas). With no memory in the way, its VPDPBUSD
// rate is the ceiling of the Q4_1 format's kernel on this core: the fold's float operations
// run on the ports that VPDPBUSD uses
static int64_t q4_mix_chains(int64_t iterations) {
  const __m512i low = _mm512_set1_epi8(0x0f);
  __m512i codes[2] = {_mm512_set1_epi8(0x5a), _mm512_set1_epi8(0x3c)};
  __m512i xs[4] = {_mm512_set1_epi8(1), _mm512_set1_epi8(2), _mm512_set1_epi8(3), _mm512_set1_epi8(4)};
  __m256i halves[2] = {_mm256_set1_epi16(0x3c00), _mm256_set1_epi16(0x3800)};  // float16 1, 0.5
  __m512 acc[4][2], dx[4], sx[4];
  for (int r = 0; r < 4; r++) dx[r] = _mm512_set1_ps(0.5f + r), sx[r] = _mm512_set1_ps(0.25f - r);
  for (int r = 0; r < 4; r++)
    for (int t = 0; t < 2; t++) acc[r][t] = _mm512_setzero_ps();
  int64_t total = 0;
  for (int64_t it = 0; it < iterations; it++) {
    __m512i sum[4][2];
    for (int r = 0; r < 4; r++)
      for (int t = 0; t < 2; t++) sum[r][t] = _mm512_setzero_si512();
    for (int j = 0; j < 4; j++) {
      __asm__ volatile("" : "+v"(codes[0]), "+v"(codes[1]));  // a new block each round
      __m512i lo[2], hi[2];
      for (int t = 0; t < 2; t++) {
        lo[t] = _mm512_and_si512(codes[t], low);
        hi[t] = _mm512_and_si512(_mm512_srli_epi16(codes[t], 4), low);
      }
      for (int r = 0; r < 4; r++)
        for (int t = 0; t < 2; t++) {
          sum[r][t] = _mm512_dpbusd_epi32(sum[r][t], lo[t], xs[r]);
          sum[r][t] = _mm512_dpbusd_epi32(sum[r][t], hi[t], xs[r]);
        }
    }
    for (int t = 0; t < 2; t++) {
      __asm__ volatile("" : "+v"(halves[0]), "+v"(halves[1]));
      const __m512 d = _mm512_cvtph_ps(halves[0]), mn = _mm512_cvtph_ps(halves[1]);
      for (int r = 0; r < 4; r++) {
        const __m512 scale = _mm512_mul_ps(d, dx[r]);
        acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r][t]), scale, acc[r][t]);
        acc[r][t] = _mm512_fmadd_ps(mn, sx[r], acc[r][t]);
      }
    }
  }
  for (int r = 0; r < 4; r++)
    for (int t = 0; t < 2; t++) total += (int64_t)_mm512_reduce_add_ps(acc[r][t]);
  return total;
}

// int8 multiply-adds per second of `rounds` (a k_avx512 loop of `vpdpbusd_a_round` VPDPBUSD
// a round) on all of torch's threads at once, counting its VPDPBUSD alone (0 without VNNI)
static double vnni_macs_per_second(int64_t (*rounds)(int64_t), int64_t vpdpbusd_a_round,
                                   int64_t iterations) {
  const int64_t threads = at::get_num_threads();
  std::vector<int64_t> sums(threads);
  const auto start = std::chrono::steady_clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; t++) sums[t] = rounds(iterations);
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  static volatile int64_t sink;
  for (int64_t sum : sums) sink = sink + sum;  // the chains' results are used
  return (double)threads * iterations * vpdpbusd_a_round * 64 / seconds;
}

// the int8 multiply-add peak: VPDPBUSD and nothing else
double int8_peak_macs(int64_t iterations) {
  return vnni_macs_per_second(vnni_chains, 12, iterations);
}

// the Q4 kernel's instruction mix (q4_mix_chains): the ceiling of Q4_1 blocks
double q4_mix_peak_macs(int64_t iterations) {
  return vnni_macs_per_second(q4_mix_chains, 64, iterations);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_peak_macs", &int8_peak_macs, "int8 multiply-adds per second, VPDPBUSD alone");
  m.def("q4_mix_peak_macs", &q4_mix_peak_macs, "the Q4 kernel's instruction mix, on registers");
}
