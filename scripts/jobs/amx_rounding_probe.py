"""Whether AMX's tdpbf16ps sums bf16 products as some fixed order of float32 roundings that AVX-512's vdpbf16ps (the
pair dot products' kernel) could reproduce: if it did, a one-row step could run on the pair dot products and a
verify on the tiles, bit for bit alike. Random bf16 inputs and weights (normal, scales 2^-8 .. 2^8), one tile of 16
x 16 sums through `instructions` tdpbf16ps of `pairs` nonzero input pairs each, each sum compared with:
  vdpbf16ps      the pair dot products' chain: per pair, odd product then even, each add rounded (as documented)
  pair rounded   per pair: both products and the sum so far added exactly, rounded once
  pairs rounded  per pair: its two products' sum rounded, then added to the sum, rounded
  one rounding   per instruction: all of its products added to the sum exactly, rounded once
Prints a table; writes JSON where an output path is given. Needs a CPU with AMX and g++ with -mamx-bf16.
    python scripts/jobs/amx_rounding_probe.py [output.json]
"""
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from draftsmith.eval.documents import cpu_model

CASES = [(1, 4), (2, 1), (4, 1), (16, 1), (16, 4), (16, 36)]  # (pairs an instruction, instructions)
ORDERS = ["vdpbf16ps", "pair rounded", "pairs rounded", "one rounding"]
SOURCE = r"""
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
struct alignas(64) Config { uint8_t palette = 1, start = 0, reserved[14] = {}; uint16_t bytes[16] = {};
                            uint8_t rows[16] = {}; };
static uint16_t to_bf16(float f) { uint32_t b; std::memcpy(&b, &f, 4); b += 0x7fff + ((b >> 16) & 1); return b >> 16; }
static float of_bf16(uint16_t h) { uint32_t b = uint32_t(h) << 16; float f; std::memcpy(&f, &b, 4); return f; }
alignas(64) static uint16_t A[64][16][32], B[64][16][32];
int main(int argc, char** argv) {
  const int pairs = std::atoi(argv[1]), steps = std::atoi(argv[2]);
  if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) return 3;
  Config config;
  for (int t = 0; t < 3; ++t) { config.rows[t] = 16; config.bytes[t] = 64; }
  _tile_loadconfig(&config);
  std::mt19937 random(1);
  std::normal_distribution<float> normal(0, 1);
  std::uniform_real_distribution<float> exponent(-8, 8);
  long same[4] = {0}, total = 0;
  for (int trial = 0; trial < 500; ++trial) {
    std::memset(A, 0, sizeof A); std::memset(B, 0, sizeof B);
    const float sa = std::exp2(exponent(random)), sb = std::exp2(exponent(random) / 2);
    for (int s = 0; s < steps; ++s)
      for (int i = 0; i < 16; ++i)
        for (int j = 0; j < 32; ++j) {
          if (j < 2 * pairs) A[s][i][j] = to_bf16(normal(random) * sa);
          if (i < pairs) B[s][i][j] = to_bf16(normal(random) * sb);
        }
    alignas(64) float C[16][16];
    _tile_zero(0);
    for (int s = 0; s < steps; ++s) { _tile_loadd(1, A[s], 64); _tile_loadd(2, B[s], 64); _tile_dpbf16ps(0, 1, 2); }
    _tile_stored(0, C, 64);
    for (int m = 0; m < 16; ++m) {
      __m512 chain = _mm512_setzero_ps();
      for (int s = 0; s < steps; ++s)
        for (int p = 0; p < 16; ++p) {
          uint32_t pair; std::memcpy(&pair, &A[s][m][2 * p], 4);
          chain = _mm512_dpbf16_ps(chain, (__m512bh)_mm512_set1_epi32(int(pair)), (__m512bh)_mm512_loadu_si512(B[s][p]));
        }
      alignas(64) float lanes[16]; _mm512_store_ps(lanes, chain);
      for (int n = 0; n < 16; ++n) {
        auto product = [&](int s, int k) { return double(of_bf16(A[s][m][k])) * of_bf16(B[s][k / 2][2 * n + k % 2]); };
        float fused = 0, rounded = 0, once = 0;
        for (int s = 0; s < steps; ++s) {
          long double exact = once;
          for (int p = 0; p < 16; ++p) {
            fused = float(double(fused) + product(s, 2 * p) + product(s, 2 * p + 1));
            rounded += float(product(s, 2 * p) + product(s, 2 * p + 1));
            exact += (long double)product(s, 2 * p) + product(s, 2 * p + 1);
          }
          once = float(exact);
        }
        const float orders[4] = {lanes[n], fused, rounded, once};
        for (int o = 0; o < 4; ++o) same[o] += std::memcmp(&orders[o], &C[m][n], 4) == 0;
        ++total;
      }
    }
  }
  _tile_release();
  std::printf("%ld %ld %ld %ld %ld\n", total, same[0], same[1], same[2], same[3]);
}
"""


def main(argv: list[str]) -> None:
    with tempfile.TemporaryDirectory() as work:
        source, binary = Path(work, "probe.cpp"), Path(work, "probe")
        source.write_text(SOURCE)
        subprocess.run(["g++", "-O2", "-mamx-tile", "-mamx-bf16", "-mavx512f", "-mavx512bw", "-mavx512bf16",
                        str(source), "-o", str(binary)], check=True)
        rows = []
        for pairs, instructions in CASES:
            out = subprocess.run([str(binary), str(pairs), str(instructions)], capture_output=True, text=True)
            if out.returncode:
                sys.exit("this CPU or kernel does not give this process AMX tiles")
            total, *same = map(int, out.stdout.split())
            rows.append({"pairs": pairs, "instructions": instructions, "sums": total,
                         "same_bits": dict(zip(ORDERS, same))})
    print(f"tdpbf16ps against float32 orders on {cpu_model()}: share of tile sums with the same bits\n")
    print("| pairs an instruction | instructions | " + " | ".join(ORDERS) + " |")
    print("|---|---|" + "---|" * len(ORDERS))
    for row in rows:
        shares = " | ".join(f"{row['same_bits'][o] / row['sums']:.4f}" for o in ORDERS)
        print(f"| {row['pairs']} | {row['instructions']} | {shares} |")
    if len(argv) > 1:
        Path(argv[1]).write_text(json.dumps({"cpu": cpu_model(), "rows": rows}, indent=1) + "\n")
        print(f"\nwrote {argv[1]}")


if __name__ == "__main__":
    main(sys.argv)
