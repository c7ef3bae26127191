// Does VPDPBUSD share its ports with float fused multiply-adds and with the nibble unpacking
// (shift + and)? Twelve independent VPDPBUSD chains a round, alone and beside independent
// chains of the other operations; prints VPDPBUSD per second on one core. A falling rate with a
// constant total of operations per cycle means shared ports (docs/native-runner.md, "The
// ceiling of Q4_1 blocks on VPDPBUSD"). Build and run (AVX-512 VNNI machines):
//
//   g++ -O3 -funroll-loops -mavx512f -mavx512bw -mavx512vnni scripts/vnni_ports.cpp -o /tmp/vnni_ports
//   /tmp/vnni_ports
#include <immintrin.h>

#include <chrono>
#include <cstdint>
#include <cstdio>

template <int FMAS, int UNPACKS>
double vpdpbusd_per_second(int64_t rounds) {
  __m512i acc[12], unpacked[8];
  __m512 floats[8];
  for (int i = 0; i < 12; i++) acc[i] = _mm512_set1_epi32(i);
  for (int i = 0; i < 8; i++) floats[i] = _mm512_set1_ps(i), unpacked[i] = _mm512_set1_epi32(i);
  __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(1);
  __m512 x = _mm512_set1_ps(1.0001f), y = _mm512_set1_ps(0.9999f);
  const auto start = std::chrono::steady_clock::now();
  for (int64_t n = 0; n < rounds; n++) {
    for (int i = 0; i < 12; i++) acc[i] = _mm512_dpbusd_epi32(acc[i], a, b);
    for (int i = 0; i < FMAS; i++) floats[i] = _mm512_fmadd_ps(floats[i], x, y);
    for (int i = 0; i < UNPACKS; i++) unpacked[i] = _mm512_and_si512(_mm512_srli_epi16(unpacked[i], 1), a);
    __asm__ volatile("" : "+v"(a), "+v"(x));  // keeps the rounds from being folded together
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  int64_t sink = 0;
  float float_sink = 0;
  for (int i = 0; i < 12; i++) sink += _mm512_reduce_add_epi32(acc[i]);
  for (int i = 0; i < 8; i++) sink += _mm512_reduce_add_epi32(unpacked[i]), float_sink += _mm512_reduce_add_ps(floats[i]);
  if (sink == 42 && float_sink == 1) std::printf(" ");  // the results are used
  return rounds * 12 / seconds;
}

int main() {
  const int64_t rounds = 200000000;
  std::printf("VPDPBUSD alone:              %.2f G/s\n", vpdpbusd_per_second<0, 0>(rounds) / 1e9);
  std::printf("+ 4 FMA chains:              %.2f G/s\n", vpdpbusd_per_second<4, 0>(rounds) / 1e9);
  std::printf("+ 6 FMA chains:              %.2f G/s\n", vpdpbusd_per_second<6, 0>(rounds) / 1e9);
  std::printf("+ 8 FMA chains:              %.2f G/s\n", vpdpbusd_per_second<8, 0>(rounds) / 1e9);
  std::printf("+ 4 shift-and chains:        %.2f G/s\n", vpdpbusd_per_second<0, 4>(rounds) / 1e9);
}
