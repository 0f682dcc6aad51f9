// What the hardware allows a verify's linear layers: a 512 MB stream (each of 2 threads its half) with F fused
// multiply-adds per vector of each 64-byte line loaded (AVX-512: one vector a line; AVX2: two) (F = 0, 8, 16: a
// float32 verify of F rows multiplies each weight F times), with the line requested DIST lines ahead (HINT 0: into
// L1, 1: into L2) and without, and the same multiply-adds over 256 KB in cache (their compute alone, scaled to the
// stream's lines). Best of 7 each; one JSON line per F.
//   stream_overlap_probe DIST HINT
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>

static size_t distance = 192;
static int hint = 0;

// A 64-byte line as the vector registers take it: one AVX-512 vector, or two AVX2 ones (a multiply-add a line is one
// instruction per vector of it).
#ifdef __AVX512F__
using V = __m512;
constexpr int PER_LINE = 1;
inline V vzero() { return _mm512_setzero_ps(); }
inline V vset1(float x) { return _mm512_set1_ps(x); }
inline V vload(const float* p) { return _mm512_load_ps(p); }
inline V vadd(V a, V b) { return _mm512_add_ps(a, b); }
inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(V a) { return _mm512_reduce_add_ps(a); }
#else
using V = __m256;
constexpr int PER_LINE = 2;
inline V vzero() { return _mm256_setzero_ps(); }
inline V vset1(float x) { return _mm256_set1_ps(x); }
inline V vload(const float* p) { return _mm256_load_ps(p); }
inline V vadd(V a, V b) { return _mm256_add_ps(a, b); }
inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(V a) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, a);
  float total = 0;
  for (float lane : lanes) total += lane;
  return total;
}
#endif

template <int F, bool AHEAD>
float sweep(const float* buffer, size_t lines) {
  float total = 0;
#pragma omp parallel num_threads(2) reduction(+ : total)
  {
    const size_t per = lines / 2, first = omp_get_thread_num() * per, last = first + per;
    V acc[8], x[8];
    for (int i = 0; i < 8; ++i) acc[i] = vzero(), x[i] = vset1(1.0f + i * 1e-3f);
    for (size_t line = first; line < last; ++line) {
      if (AHEAD) {
        const char* ahead = reinterpret_cast<const char*>(buffer + (line + distance) * 16);
        if (hint == 0) _mm_prefetch(ahead, _MM_HINT_T0);
        else _mm_prefetch(ahead, _MM_HINT_T1);
      }
      for (int part = 0; part < PER_LINE; ++part) {
        const V w = vload(buffer + line * 16 + part * (16 / PER_LINE));
#pragma GCC unroll 32
        for (int f = 0; f < F; ++f) acc[f % 8] = vfma(w, x[f % 8], acc[f % 8]);
        if (F == 0) acc[0] = vadd(acc[0], w);
      }
    }
    for (int i = 1; i < 8; ++i) acc[0] = vadd(acc[0], acc[i]);
    total += vsum(acc[0]);
  }
  return total;
}

template <int F, bool AHEAD>
double best_seconds(const float* buffer, size_t lines) {
  double best = 1e9;
  volatile float sink = 0;
  for (int rep = 0; rep < 7; ++rep) {
    const auto start = std::chrono::steady_clock::now();
    sink = sink + sweep<F, AHEAD>(buffer, lines);
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  return best;
}

template <int F>
void report(const float* stream, size_t lines, const float* cached, size_t cached_lines) {
  const double plain = best_seconds<F, false>(stream, lines), ahead = best_seconds<F, true>(stream, lines);
  const double compute = best_seconds<F, false>(cached, cached_lines) * double(lines) / double(cached_lines);
  printf("{\"fmas_per_line\": %d, \"stream_ms\": %.3f, \"requested_ahead_ms\": %.3f, \"compute_ms\": %.3f}\n", F,
         1e3 * plain, 1e3 * ahead, 1e3 * compute);
}

int main(int argc, char** argv) {
  if (argc > 2) distance = size_t(atol(argv[1])), hint = atoi(argv[2]);
  const size_t bytes = size_t(512) << 20, slack = 64 * 4096, cached_bytes = size_t(256) << 10;
  float* stream = static_cast<float*>(aligned_alloc(64, bytes + slack));
  float* cached = static_cast<float*>(aligned_alloc(64, cached_bytes + slack));
  memset(stream, 1, bytes + slack);
  memset(cached, 1, cached_bytes + slack);
  report<0>(stream, bytes / 64, cached, cached_bytes / 64);
  report<8>(stream, bytes / 64, cached, cached_bytes / 64);
  report<16>(stream, bytes / 64, cached, cached_bytes / 64);
}
