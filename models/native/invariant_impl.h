// The kernels of batch_invariant.cpp, written once over a small vector vocabulary and compiled once per
// instruction set (batch_invariant.cpp includes this file inside a namespace and a `#pragma GCC target`).
//
// Before including, the including namespace defines: VL (lanes), V (a float vector), vzero, vset1, vload,
// vload_partial, vmask_tail, vstore, vstore_out (float or bf16, the first n lanes), vfma, vmul, vadd, vmax,
// vreduce_add, vreduce_each (vreduce_add of VL vectors at once, bit for bit), vreduce_max, vvisible_bits (lanes
// above MASKED_BELOW), vload_i8 (int8 -> floats), vload_bf16_partial, vload_bf16_pairs, vexp, DPBF16 (1 where a
// bf16 pair dot exists: vdpbf16), and for int8 x int8 dot products VI (VL int32 lanes), vizero, viload (VL quads of
// int8 weights, + WEIGHT_BIAS where the dot product takes them unsigned), vquantize (round floats to int8), XQ and
// vquad (four int8 inputs, prepared once for every lane), vdp_i8 (each lane += the dot of its weight quad with the
// inputs', exactly) and vblock_float (an accumulator less a correction, as floats: exact below 2^24).
//
// Batch invariance: every output element is reduced by the same sequence of operations whatever the number of
// rows, the thread count, and (for attention) wherever its visible keys lie in the cache.

constexpr int PANEL = 48;  // output columns per packed weight panel (kernels.py's PANEL)
constexpr int PANEL_VECTORS = PANEL / VL;
// The register tile: TILE_ROWS rows x TILE_VECTORS vectors of accumulators (AVX-512: 9 x 3 of 32 registers, so a
// verify of up to 9 rows streams each weight once, in one pass, and more rows take passes of up to 9, over whole
// panels or, in float32 on a CPU with AMX, over chunks of them: chunked_passes_kernel; AVX2: 4 x 3, all 16).
constexpr int TILE_VECTORS = VL == 1 ? 4 : 3;
constexpr int TILE_ROWS = VL == 16 ? 9 : VL == 8 ? 4 : 2;
// Where that tile is narrower than a panel (AVX2: 3 of its 6 vectors), half-panel tasks read each panel row's 192
// bytes as two overlapping 96-byte runs, a stream the hardware prefetcher follows worse, and each task sweeps all K
// inputs, its weights from L2 after its first pass. So float32 weights take every row count in the wide kernel
// instead (wide_linear_kernel: a task per panel, up to WIDE_UP_TO rows swept together over chunks of inputs held in
// L1; more rows in groups of near-equal counts): a step of linear layers of 3-64 rows costs 8-25% less than in pairs
// of rows and the narrow tile (eval.kernel_ab on the AVX2 EPYC). bf16 and int8 weights: one row wide (6
// accumulators and the 6 converted weight vectors; with two rows they spill), more in the narrow tile. 0: none.
constexpr int WIDE_ROWS = TILE_VECTORS < PANEL_VECTORS && VL == 8 ? 2 : 0;
constexpr int WIDE_UP_TO = 64;  // the compiled engine's largest default bucket (its prompt chunks)

inline float x_value(const float* x, int64_t i) { return x[i]; }
inline float x_value(const uint16_t* x, int64_t i) { return bf16_to_float(x[i]); }

// Every accumulator: acc = fma(x[m, k], w[k, n], acc) for k = 0, 1, ..., K - 1 (bf16 pairs: k even, then odd, or
// one bf16 dot per pair), whatever tile it sits in. Weight panels: float32 / int8 (panels, K, 64); bf16 as pairs
// (panels, K/2, 64, 2).
inline V load_weight(const float* p) { return vload(p); }
inline V load_weight(const int8_t* p) { return vload_i8(p); }  // exact: int8 -> float

// A tile of one row spends so little time on each input that the hardware prefetcher falls behind the weight stream
// (a one-row forward streamed ~10% slower than a four-row one): it requests the weights PREFETCH_BYTES ahead, into
// L2. Wider tiles streamed as fast without when first measured, and the requests cost them time: two-row tiles with
// them took 3-15% longer than one-row ones (bf16 8%, w8a8 9-15%; eval.kernel_ab on a Zen 4). Measured for float32
// and bfloat16 weights and int8 x int8 quads; weight-only int8 takes them as the others do (on the AVX2 EPYC its
// one-row step was faster with them in 4 of 6 alternations of eval.kernel_ab, 2% on the mean: within that VM's noise,
// results/engine_kernels_epyc_avx2/kernel_ab/). Except float32 weights on AVX2: their one-row tile (6 weight vectors
// an input, read straight into the fmas) streams faster on the hardware prefetcher alone: a step of linear layers at
// one row 20.2-20.7 -> 17.8-18.9 ms in eval.kernel_ab on the AVX2 EPYC, now as fast as the two-row tile, which never
// requested (results/engine_kernels_epyc_avx2/kernel_ab/float32_one_row_no_prefetch; less in 12 of 13 alternations
// of the trials before it, kernel_ab/verify_row_trials); weight-only int8's one row was 13-16% slower without. On the
// Zen 4 (AVX-512) the one-row tile without requests: fp32 and w8a8 no faster, weight-only int8 slower
// (results/engine_kernels_zen4/kernel_ab/one_row_no_prefetch).
// On AVX-512 tiles of every row count request theirs (bf16 and int8 ones only where one pass takes the panel:
// prefetch_ahead). In every alternation of eval.kernel_ab on the Zen 4, a step of linear layers against a one-row one:
// bf16, weight-only int8 and int8 x int8 at two rows 1.10-1.42 -> 0.91-1.01 (two_row_prefetch_non_float); float32 at
// 8-9 rows 1.16-1.33 -> 0.94-1.04 (float32_tiles_request_ahead); bf16 at 4-9 rows 1.08-1.57 -> 0.97-1.09,
// weight-only int8 at 8-9 rows 2.30-2.79 -> 1.39-1.55 (nonfloat_one_pass_request_ahead; all under
// results/engine_kernels_zen4/kernel_ab/).
constexpr int PREFETCH_ROWS = 1;
constexpr int64_t PREFETCH_BYTES = 6144;

template <typename WT>
constexpr int prefetch_rows() {
  if constexpr (VL == 16) return TILE_ROWS;  // every tile: AVX-512
  else if constexpr (std::is_same_v<WT, float>) return VL == 8 ? 0 : PREFETCH_ROWS;
  else return PREFETCH_ROWS;
}

// Where a panel takes more than one sweep (several passes of the tile, or tasks of part of its width: AVX2), the
// sweeps after the first read it from L2 and the memory stream stopped while they computed (a verify of 8 rows on
// AVX2 cost 1.2-1.6 steps, 16 rows on AVX-512 1.45). So each sweep requests its share of the next panel as it goes,
// `stride` bytes per input: the sweeps of a panel together request the whole next one, spread over their time.
struct Ahead {
  const char* next = nullptr;  // null: no requests
  int64_t stride = 0;

  // The share of inputs k .. k + count - 1.
  void request(int64_t k, int64_t count) const {
    if (!next) return;
    for (int64_t b = k * stride; b < (k + count) * stride; b += 64) __builtin_prefetch(next + b, 0, 2);
  }
};

// Sweep `sweep` of `sweeps` over a panel of `panel_bytes` and K inputs, the next panel at `next` (null: none).
inline Ahead sweep_ahead(const void* next, int64_t panel_bytes, int64_t sweep, int64_t sweeps, int64_t K) {
  if (!next || sweeps < 2) return {};
  return {static_cast<const char*>(next) + sweep * panel_bytes / sweeps, panel_bytes / (sweeps * K)};
}

// The `bytes` of weights a tile reads at `w` for one input (a pair, a quad), requested PREFETCH_BYTES ahead: by
// tiles of up to prefetch_rows<WT>() rows; bf16 and int8 ones only where no sweep requests their panel (`ahead`
// null: one pass over it). Where the sweeps of a panel request it too, both requests together made a step of linear
// layers at 16 rows (bf16, weight-only int8) or 8-16 (int8 x int8, a tile of 4 rows) slower than the sweeps' alone
// (eval.kernel_ab on the Zen 4, results/engine_kernels_zen4/kernel_ab/every_tile_request_ahead), float32 faster.
// On AVX2 the rule reaches one-row bf16 and int8 tiles left over from an odd row count above one (unmeasured there).
template <int MB, typename WT>
inline void prefetch_ahead(const WT* w, int64_t bytes, const Ahead& ahead) {
  if constexpr (MB <= prefetch_rows<WT>()) {
    if (!std::is_same_v<WT, float> && ahead.next) return;
    const char* line = reinterpret_cast<const char*>(w) + PREFETCH_BYTES;
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(line + b, 0, 2);
  }
}

// A sweep requests its share of the next chunk once per AHEAD_GROUP inputs: a request at every input (its arithmetic
// and branch, and the rows' pointers it pushed out of registers onto the stack) cost the wide sweeps a fifth of their
// rate (eval.kernel_ab on the AVX2 EPYC: the fp32 linear layers of a step at 8-9 rows 11-14% less time without it, at
// 16-32 rows 25-27%). Setting the rows' pointers once before the loop instead spilled the int8 tiles of 2-3 rows (a
// third slower). Each accumulator still sums its inputs in order.
constexpr int64_t AHEAD_GROUP = 8;

// Inputs k0 .. k1 - 1 of the tile (tile_fma: all K of them).
template <int MB, int NV, typename XT, typename WT>
inline void tile_fma_range(const XT* x, int64_t ldx, const WT* panel, int64_t k0, int64_t k1, int c0, V acc[MB][NV],
                           const Ahead& ahead) {
  for (int64_t group = k0; group < k1; group += AHEAD_GROUP) {
    const int64_t last = std::min(k1, group + AHEAD_GROUP);
    ahead.request(group, last - group);
    for (int64_t k = group; k < last; ++k) {
      const WT* w = panel + k * PANEL + c0;
      prefetch_ahead<MB>(w, NV * VL * sizeof(WT), ahead);
      V wv[NV];
      for (int v = 0; v < NV; ++v) wv[v] = load_weight(w + v * VL);
      for (int m = 0; m < MB; ++m) {
        V xb = vset1(x_value(x, m * ldx + k));
        for (int v = 0; v < NV; ++v) acc[m][v] = vfma(xb, wv[v], acc[m][v]);
      }
    }
  }
}

template <int MB, int NV, typename XT, typename WT>
inline void tile_fma(const XT* x, int64_t ldx, const WT* panel, int64_t K, int c0, V acc[MB][NV], const Ahead& ahead) {
  tile_fma_range<MB, NV>(x, ldx, panel, 0, K, c0, acc, ahead);
}

// Inputs 2p and 2p + 1 of a row as one bf16 pair (the second 0 past K): one 4-byte load where the pair is whole,
// so the dot product broadcasts it straight from memory (assembling it from two 2-byte loads in a register cost the
// bf16 tile half its rate).
template <bool WHOLE>
inline uint32_t input_pair(const uint16_t* xr) {
  uint32_t pair = xr[0];
  if constexpr (WHOLE) std::memcpy(&pair, xr, sizeof(pair));
  return pair;
}

template <int MB, int NV, bool WHOLE>
inline void pair_fma(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t p, V acc[MB][NV],
                     const Ahead& ahead) {
  prefetch_ahead<MB>(w, 2 * NV * VL * sizeof(uint16_t), ahead);
  for (int m = 0; m < MB; ++m) {
    const uint32_t pair = input_pair<WHOLE>(x + m * ldx + 2 * p);
#if DPBF16
    for (int v = 0; v < NV; ++v) acc[m][v] = vdpbf16(acc[m][v], pair, w + 2 * v * VL);
#else
    V x0 = vset1(bf16_to_float(uint16_t(pair))), x1 = vset1(bf16_to_float(uint16_t(pair >> 16)));
    for (int v = 0; v < NV; ++v) {
      V w0, w1;
      vload_bf16_pairs(w + 2 * v * VL, &w0, &w1);
      acc[m][v] = vfma(x1, w1, vfma(x0, w0, acc[m][v]));
    }
#endif
  }
}

template <int MB, int NV>
inline void tile_bf16(const uint16_t* x, int64_t ldx, const uint16_t* panel, int64_t K, int c0, V acc[MB][NV],
                      const Ahead& ahead) {
  const int64_t whole = K / 2;
  for (int64_t group = 0; group < whole; group += AHEAD_GROUP / 2) {  // requests once per AHEAD_GROUP inputs
    const int64_t last = std::min(whole, group + AHEAD_GROUP / 2);
    ahead.request(2 * group, 2 * (last - group));
    for (int64_t p = group; p < last; ++p)
      pair_fma<MB, NV, true>(x, ldx, panel + (p * PANEL + c0) * 2, p, acc, ahead);
  }
  if (K % 2) {
    ahead.request(2 * whole, 2);
    pair_fma<MB, NV, false>(x, ldx, panel + (whole * PANEL + c0) * 2, whole, acc, ahead);
  }
}

template <int NV, typename OT>
inline void store_row(OT* out, const V acc[NV], int64_t column, int64_t N, const float* scale, const float* bias) {
  for (int v = 0; v < NV; ++v) {
    int64_t c = column + v * VL;
    if (c >= N) return;
    int valid = int(std::min<int64_t>(VL, N - c));
    V value = acc[v];
    if (scale) value = vmul(value, vload_partial(scale + c, valid));
    if (bias) value = vadd(value, vload_partial(bias + c, valid));
    vstore_out(out + c, value, valid);
  }
}

template <int MB, int NV, typename XT, typename WT, typename OT>
inline void tile(const XT* x, int64_t K, const WT* panel, int c0, OT* out, int64_t column, int64_t N,
                 const float* scale, const float* bias, const Ahead& ahead) {
  V acc[MB][NV];
  for (int m = 0; m < MB; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = vzero();
  if constexpr (std::is_same_v<WT, uint16_t>) tile_bf16<MB, NV>(x, K, panel, K, c0, acc, ahead);
  else tile_fma<MB, NV>(x, K, panel, K, c0, acc, ahead);
  for (int m = 0; m < MB; ++m) store_row<NV>(out + m * N, acc[m], column, N, scale, bias);
}

// run(std::integral_constant<int, rows>, m, pass) for rows m .. m + rows - 1, rows <= ROWS a compile-time constant.
template <int ROWS, typename Run>
inline void with_rows(int64_t rows, int64_t m, int64_t pass, const Run& run) {
  if constexpr (ROWS >= 1) {
    if (rows == ROWS) return run(std::integral_constant<int, ROWS>{}, m, pass);
    with_rows<ROWS - 1>(rows, m, pass, run);
  }
}

template <int ROWS>
constexpr int64_t passes_of(int64_t M) { return (M + ROWS - 1) / ROWS; }

// Every row of one task, in passes of near-equal row counts <= ROWS (so a verify of 10 rows is two passes of 5).
template <int ROWS, typename Run>
inline void in_passes(int64_t M, const Run& run) {
  const int64_t passes = passes_of<ROWS>(M);
  for (int64_t pass = 0, m = 0; pass < passes; ++pass) {
    const int64_t rows = (M - m) / (passes - pass);
    with_rows<ROWS>(rows, m, pass, run);
    m += rows;
  }
}

// The next panel a task's sweeps request, where its rows take that (more than PREFETCH_ROWS: fewer request their own
// weights ahead); null after the last panel.
inline const void* next_panel(const void* packed, int64_t p, int64_t panels, int64_t panel_bytes, int64_t M) {
  if (M <= PREFETCH_ROWS || p + 1 >= panels) return nullptr;
  return static_cast<const char*>(packed) + (p + 1) * panel_bytes;
}

// linear_kernel for up to WIDE_UP_TO rows (fp32 weights; bf16 and int8: one row): a task per panel, its whole width in
// each sweep. More rows than one pass takes (fp32 weights) go in sweeps over the panel WIDE_CHUNK inputs at a time:
// four rows over each half of it (4 x 3 accumulators and the 3 weight vectors), a pair over the whole panel (2 x 6, the
// weights read straight into the fmas) and three rows over each half (3 x 3): a verify of M rows takes its rows in
// quads, then a pair where two are left, and three where M is odd, so every row is computed once (before, an odd M's
// last pair took the row before it again: a verify of 3 rows cost what one of 4 did, and 5 what 6 did; quads load fewer
// vectors a product than pairs). Each chunk comes from memory in the first sweep and from L1 in the others, and every
// sweep requests its share of the next chunk (the weights are one stream: a panel's inputs in order, the next panel
// after it), so the memory stream runs on through every sweep. The accumulators wait in L1 between chunks (stored and
// reloaded exactly: each element's sum still runs over k in order, in whatever tile).
constexpr int64_t WIDE_CHUNK = 64;  // 64 inputs x 192 bytes of fp32 panel: 12 KB, well inside L1
constexpr int WIDE_TILE_ROWS = WIDE_ROWS > 0 ? WIDE_ROWS : 1;
constexpr int QUAD_ROWS = 4, TRIPLE_ROWS = 3;
constexpr int WIDE_QUADS = WIDE_UP_TO / QUAD_ROWS;
constexpr int HALF_VECTORS = PANEL_VECTORS / 2 > 0 ? PANEL_VECTORS / 2 : 1;

// The sweeps of M (> WIDE_TILE_ROWS) rows, in this order: `quads` quads from row 0, a pair, three rows.
struct WidePlan {
  int64_t quads;
  bool pair, triple;
  int64_t pair_row() const { return quads * QUAD_ROWS; }
  int64_t triple_row() const { return pair_row() + (pair ? WIDE_TILE_ROWS : 0); }
  int64_t sweeps() const { return 2 * quads + (pair ? 1 : 0) + (triple ? 2 : 0); }
};

inline WidePlan wide_plan(int64_t M) {
  const bool triple = M % 2 != 0;
  const int64_t even = M - (triple ? TRIPLE_ROWS : 0);
  return {even / QUAD_ROWS, even % QUAD_ROWS != 0, triple};
}

struct WideAccumulators {
  V quads[WIDE_QUADS][QUAD_ROWS][PANEL_VECTORS];
  V pair[WIDE_TILE_ROWS][PANEL_VECTORS];
  V triple[TRIPLE_ROWS][PANEL_VECTORS];
};

// Inputs k0 .. k1 - 1 of MB rows x NV vectors of accumulators from column vector `v0` of `acc` (rows of
// PANEL_VECTORS), through a register tile.
template <int MB, int NV, typename XT, typename WT>
inline void wide_sweep(const XT* x, int64_t K, const WT* panel, int64_t k0, int64_t k1, int v0,
                       V acc[][PANEL_VECTORS], const Ahead& ahead) {
  V tile_acc[MB][NV];  // in registers for the chunk
  for (int r = 0; r < MB; ++r)
    for (int v = 0; v < NV; ++v) tile_acc[r][v] = acc[r][v0 + v];
  tile_fma_range<MB, NV>(x, K, panel, k0, k1, v0 * VL, tile_acc, ahead);
  for (int r = 0; r < MB; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v0 + v] = tile_acc[r][v];
}

template <typename XT, typename WT>
inline void wide_passes(const XT* x, const WidePlan& plan, int64_t K, const WT* panel, WideAccumulators& acc) {
  const int64_t stride = PANEL * int64_t(sizeof(WT)) / plan.sweeps();
  for (int64_t k0 = 0; k0 < K; k0 += WIDE_CHUNK) {
    const int64_t k1 = std::min<int64_t>(K, k0 + WIDE_CHUNK);
    const char* next = reinterpret_cast<const char*>(panel + k1 * PANEL);  // the chunk after this one
    int64_t sweep = 0;  // each sweep requests its share of the next chunk
    auto ahead = [&]() { return Ahead{next + (sweep++ * (k1 - k0) - k0) * stride, stride}; };
    for (int64_t quad = 0; quad < plan.quads; ++quad)
      for (int half = 0; half < 2; ++half)
        wide_sweep<QUAD_ROWS, HALF_VECTORS>(x + quad * QUAD_ROWS * K, K, panel, k0, k1, half * HALF_VECTORS,
                                            acc.quads[quad], ahead());
    if (plan.pair)
      wide_sweep<WIDE_TILE_ROWS, PANEL_VECTORS>(x + plan.pair_row() * K, K, panel, k0, k1, 0, acc.pair, ahead());
    if (plan.triple)
      for (int half = 0; half < 2; ++half)
        wide_sweep<TRIPLE_ROWS, HALF_VECTORS>(x + plan.triple_row() * K, K, panel, k0, k1, half * HALF_VECTORS,
                                              acc.triple, ahead());
  }
}

template <typename OT>
inline void store_rows(const V acc[][PANEL_VECTORS], int64_t rows, OT* out, int64_t column, int64_t N,
                       const float* scale, const float* bias) {
  for (int64_t r = 0; r < rows; ++r) store_row<PANEL_VECTORS>(out + r * N, acc[r], column, N, scale, bias);
}

template <typename OT>
inline void store_wide(const WidePlan& plan, const WideAccumulators& acc, OT* out, int64_t column, int64_t N,
                       const float* scale, const float* bias) {
  for (int64_t quad = 0; quad < plan.quads; ++quad)
    store_rows(acc.quads[quad], QUAD_ROWS, out + quad * QUAD_ROWS * N, column, N, scale, bias);
  if (plan.pair) store_rows(acc.pair, WIDE_TILE_ROWS, out + plan.pair_row() * N, column, N, scale, bias);
  if (plan.triple) store_rows(acc.triple, TRIPLE_ROWS, out + plan.triple_row() * N, column, N, scale, bias);
}

template <typename XT, typename WT, typename OT>
void wide_linear_kernel(const XT* x, int64_t M, int64_t K, const WT* packed, int64_t N, const float* scale,
                        const float* bias, OT* out, int64_t panels, int64_t panel_size) {
#pragma omp parallel for schedule(static) if (panels > 1)
  for (int64_t p = 0; p < panels; ++p) {
    const WT* panel = packed + p * panel_size;
    if constexpr (std::is_same_v<WT, float>) {
      if (M > WIDE_TILE_ROWS) {  // more than one pass (one pass: the whole panel at once, below)
        const WidePlan plan = wide_plan(M);
        WideAccumulators acc{};  // every accumulator +0.0f
        wide_passes(x, plan, K, panel, acc);
        store_wide(plan, acc, out, p * PANEL, N, scale, bias);
        continue;
      }
    }
    with_rows<WIDE_TILE_ROWS>(M, 0, 0, [&](auto rows, int64_t, int64_t) {
      tile<decltype(rows)::value, PANEL_VECTORS>(x, K, panel, 0, out, p * PANEL, N, scale, bias, Ahead{});
    });
  }
}

// AVX-512, float32 weights, more rows than one pass of the tile takes (a verify of 10-64 rows), where
// float32_chunked_passes() (the CPU has AMX; batch_invariant.cpp says why): a task per panel, its passes (near-equal
// row counts <= TILE_ROWS) over chunks of WIDE_CHUNK inputs, so a chunk comes from memory in the first pass and from
// L1 in the others (not the whole panel from L2), and every pass requests its share of the next chunk. The
// accumulators wait in L1 between chunks (stored and reloaded exactly: each element's sum still runs over k in
// order). In every alternation of eval.kernel_ab on the Xeon, a step of linear layers against a one-row one: 10
// rows 1.42-1.48 -> 1.31-1.34, 16 rows 1.57-1.63 -> 1.48-1.54, 32 rows 2.24-2.28 -> 2.15-2.23, 8 rows (one pass,
// unchanged) 1.18-1.22 (results/engine_kernels_xeon/kernel_ab/float32_chunked_passes).
template <typename XT, typename OT>
void chunked_passes_kernel(const XT* x, int64_t M, int64_t K, const float* packed, int64_t N, const float* scale,
                           const float* bias, OT* out, int64_t panels, int64_t panel_size) {
  const int64_t stride = PANEL * int64_t(sizeof(float)) / passes_of<TILE_ROWS>(M);  // a pass's share of a chunk
#pragma omp parallel for schedule(static) if (panels > 1)
  for (int64_t p = 0; p < panels; ++p) {
    const float* panel = packed + p * panel_size;
    V acc[WIDE_UP_TO][PANEL_VECTORS];
    for (int64_t m = 0; m < M; ++m)
      for (int v = 0; v < PANEL_VECTORS; ++v) acc[m][v] = vzero();
    for (int64_t k0 = 0; k0 < K; k0 += WIDE_CHUNK) {
      const int64_t k1 = std::min<int64_t>(K, k0 + WIDE_CHUNK);
      const char* next = reinterpret_cast<const char*>(panel + k1 * PANEL);  // the chunk after this one
      in_passes<TILE_ROWS>(M, [&](auto rows, int64_t m, int64_t pass) {
        const Ahead ahead{next + (pass * (k1 - k0) - k0) * stride, stride};
        wide_sweep<decltype(rows)::value, PANEL_VECTORS>(x + m * K, K, panel, k0, k1, 0, acc + m, ahead);
      });
    }
    store_rows(acc, M, out, p * PANEL, N, scale, bias);
  }
}

// run(m, rows) for the rows of M in groups of near-equal counts up to WIDE_UP_TO (the wide and chunked kernels'
// accumulators hold that many rows).
template <typename Run>
inline void in_row_groups(int64_t M, const Run& run) {
  const int64_t groups = (M + WIDE_UP_TO - 1) / WIDE_UP_TO;
  for (int64_t group = 0, m = 0; group < groups; ++group) {
    const int64_t rows = (M - m) / (groups - group);
    run(m, rows);
    m += rows;
  }
}

// y (M, N) = x (M, K) . W^T (+ per-column scale, + bias), W packed in panels of PANEL columns. Threads take
// contiguous runs of tasks, so each streams its weights in order.
template <typename XT, typename WT, typename OT>
void linear_kernel(const XT* x, int64_t M, int64_t K, const WT* packed, int64_t N, const float* scale,
                   const float* bias, OT* out) {
  const int64_t panels = (N + PANEL - 1) / PANEL;
  const int64_t panel_size = std::is_same_v<WT, uint16_t> ? ((K + 1) / 2) * PANEL * 2 : K * PANEL;
  if constexpr (WIDE_ROWS > 0) {
    if constexpr (std::is_same_v<WT, float>) {  // every row count
      return in_row_groups(M, [&](int64_t m, int64_t rows) {
        wide_linear_kernel(x + m * K, rows, K, packed, N, scale, bias, out + m * N, panels, panel_size);
      });
    }
    if (M == 1) return wide_linear_kernel(x, M, K, packed, N, scale, bias, out, panels, panel_size);
  }
  if constexpr (VL == 16 && std::is_same_v<WT, float>) {
    if (M > TILE_ROWS && float32_chunked_passes()) {
      return in_row_groups(M, [&](int64_t m, int64_t rows) {
        chunked_passes_kernel(x + m * K, rows, K, packed, N, scale, bias, out + m * N, panels, panel_size);
      });
    }
  }
  const int64_t subs = PANEL_VECTORS / TILE_VECTORS;
  const int64_t tasks = panels * subs;
#pragma omp parallel for schedule(static) if (tasks > 1)
  for (int64_t task = 0; task < tasks; ++task) {
    const int64_t p = task / subs, sub = task % subs, passes = passes_of<TILE_ROWS>(M);
    const int c0 = int(sub * TILE_VECTORS * VL);
    const int64_t panel_bytes = panel_size * int64_t(sizeof(WT));
    const void* next = next_panel(packed, p, panels, panel_bytes, M);
    in_passes<TILE_ROWS>(M, [&](auto rows, int64_t m, int64_t pass) {
      const Ahead ahead = sweep_ahead(next, panel_bytes, sub * passes + pass, subs * passes, K);
      tile<decltype(rows)::value, TILE_VECTORS>(x + m * K, K, packed + p * panel_size, c0, out + m * N, p * PANEL + c0,
                                                N, scale, bias, ahead);
    });
  }
}

// ---- int8 x int8: int8 weights (a scale per output column), inputs quantized in blocks as they arrive -----------
//
// Each row's inputs go in blocks of ACT_BLOCK (as llama.cpp's q8_0): a block's q = round(x * 127 / max|x|) (to
// nearest even; zeros where max|x| = 0), its scale max|x| / 127, from that block alone. A block's dot product with a
// weight column is an exact int32 sum (an integer sum has no order), converted exactly (|sum| < 2^24) and added in
// block order: acc = fma(float(sum), block scale, acc); the output is acc * column scale + bias. So every output is
// the same bits whatever the rows, the threads or the instruction set. Weights are packed as quads (panels, K/4,
// PANEL, 4), the quantized inputs as quads too. An instruction set whose dot product takes unsigned weights
// (VNNI) reads w + WEIGHT_BIAS and takes WEIGHT_BIAS x the block's sum of q off, exactly, per row and block.

constexpr int QUAD = 4;
constexpr int ACT_BLOCK = 32;
constexpr int BLOCK_QUADS = ACT_BLOCK / QUAD;
// The register tile: int32 and float accumulators for I8_TILE_ROWS x I8_TILE_VECTORS (AVX-512: 4 x 3, 24 of 32
// registers; AVX2: 2 x 2 of 16).
constexpr int I8_TILE_VECTORS = VL == 16 ? 3 : VL == 8 ? 2 : 4;
constexpr int I8_TILE_ROWS = VL == 16 ? 4 : 2;

struct QuantizedRows {
  int64_t quads, blocks;
  std::vector<uint32_t> q;           // (rows, quads): four int8 inputs each
  std::vector<float> scale;          // (rows, blocks)
  std::vector<int32_t> correction;   // (rows, blocks): WEIGHT_BIAS x the block's sum of q
};

// Inputs k0 .. k1 - 1 of a row, one block, into q (zero padded to whole quads by the caller); returns its scale.
inline float quantize_block(const float* x, int64_t k0, int64_t k1, int8_t* q, int32_t* correction) {
  V largest = vzero();
  for (int64_t k = k0; k < k1; k += VL) {
    const V v = vload_partial(x + k, int(std::min<int64_t>(VL, k1 - k)));
    largest = vmax(largest, vmax(v, vmul(v, vset1(-1.0f))));
  }
  const float amax = vreduce_max(largest);
  *correction = 0;
  if (!(amax > 0.0f)) return 0.0f;
  const V inverse = vset1(127.0f / amax);
  for (int64_t k = k0; k < k1; k += VL) {
    const int valid = int(std::min<int64_t>(VL, k1 - k));
    vquantize(q + k, vmul(vload_partial(x + k, valid), inverse), valid);
  }
  int32_t total = 0;
  for (int64_t k = k0; k < k1; ++k) total += q[k];
  *correction = WEIGHT_BIAS * total;
  return amax / 127.0f;
}

inline QuantizedRows quantize_rows(const float* x, int64_t M, int64_t K) {
  QuantizedRows r;
  r.quads = (K + QUAD - 1) / QUAD;
  r.blocks = (K + ACT_BLOCK - 1) / ACT_BLOCK;
  r.q.assign(size_t(M * r.quads), 0u);
  r.scale.resize(size_t(M * r.blocks));
  r.correction.resize(size_t(M * r.blocks));
  for (int64_t m = 0; m < M; ++m) {
    int8_t* q = reinterpret_cast<int8_t*>(r.q.data() + m * r.quads);
    for (int64_t b = 0; b < r.blocks; ++b)
      r.scale[m * r.blocks + b] = quantize_block(x + m * K, b * ACT_BLOCK, std::min<int64_t>(K, (b + 1) * ACT_BLOCK),
                                                 q, &r.correction[m * r.blocks + b]);
  }
  return r;
}

template <int MB, int NV>
inline void tile_i8(const QuantizedRows& x, int64_t m0, const int8_t* panel, int c0, float* out, int64_t column,
                    int64_t N, const float* scale, const float* bias, const Ahead& ahead) {
  V total[MB][NV];
  for (int m = 0; m < MB; ++m)
    for (int v = 0; v < NV; ++v) total[m][v] = vzero();
  for (int64_t b = 0; b < x.blocks; ++b) {
    VI acc[MB][NV];
    for (int m = 0; m < MB; ++m)
      for (int v = 0; v < NV; ++v) acc[m][v] = vizero();
    const int64_t end = std::min<int64_t>(x.quads, (b + 1) * BLOCK_QUADS);
    ahead.request(b * BLOCK_QUADS * QUAD, (end - b * BLOCK_QUADS) * QUAD);  // once a block of inputs
    for (int64_t p = b * BLOCK_QUADS; p < end; ++p) {
      const int8_t* w = panel + (p * PANEL + c0) * QUAD;
      prefetch_ahead<MB>(w, NV * VL * QUAD, ahead);
      VI wv[NV];
      for (int v = 0; v < NV; ++v) wv[v] = viload(w + v * VL * QUAD);
      for (int m = 0; m < MB; ++m) {
        const XQ q = vquad(x.q[(m0 + m) * x.quads + p]);
        for (int v = 0; v < NV; ++v) acc[m][v] = vdp_i8(acc[m][v], q, wv[v]);
      }
    }
    for (int m = 0; m < MB; ++m) {
      const int64_t at = (m0 + m) * x.blocks + b;
      const V block_scale = vset1(x.scale[at]);
      for (int v = 0; v < NV; ++v)
        total[m][v] = vfma(vblock_float(acc[m][v], x.correction[at]), block_scale, total[m][v]);
    }
  }
  for (int m = 0; m < MB; ++m) store_row<NV>(out + (m0 + m) * N, total[m], column, N, scale, bias);
}

// y (M, N) = x (M, K) quantized in blocks . W^T, W int8 in quad panels with a float32 scale per column; the tasks
// as linear_kernel's.
inline void linear_i8_kernel(const float* x, int64_t M, int64_t K, const int8_t* packed, int64_t N, const float* scale,
                             const float* bias, float* out) {
  const QuantizedRows rows = quantize_rows(x, M, K);
  const int64_t panels = (N + PANEL - 1) / PANEL, panel_size = rows.quads * PANEL * QUAD;
  const int64_t subs = PANEL_VECTORS / I8_TILE_VECTORS, tasks = panels * subs;
#pragma omp parallel for schedule(static) if (tasks > 1)
  for (int64_t task = 0; task < tasks; ++task) {
    const int64_t p = task / subs, sub = task % subs, passes = passes_of<I8_TILE_ROWS>(M);
    const int c0 = int(sub * I8_TILE_VECTORS * VL);
    const void* next = next_panel(packed, p, panels, panel_size, M);
    in_passes<I8_TILE_ROWS>(M, [&](auto count, int64_t m, int64_t pass) {
      const Ahead ahead = sweep_ahead(next, panel_size, sub * passes + pass, subs * passes, rows.quads * QUAD);
      tile_i8<decltype(count)::value, I8_TILE_VECTORS>(rows, m, packed + p * panel_size, c0, out, p * PANEL + c0, N,
                                                       scale, bias, ahead);
    });
  }
}

// ---- attention ------------------------------------------------------------------------------------------------

template <typename T>
inline V load_row(const T* p, int64_t d, int valid) {
  if constexpr (std::is_same_v<T, float>) return vload_partial(p + d, valid);
  else return vload_bf16_partial(p + d, valid);
}

// Attention over a row's visible keys, taken in cache order and compacted, so where they lie (a tree's scattered
// ancestors, a chain's contiguous slots) changes nothing. The visible keys go in blocks of KEY_BLOCK: each block
// gives, per head, its largest score, the sum of exp(score - largest) and the values weighted by those, and the
// blocks combine in order (combine_blocks). A row's blocks depend only on how many keys it sees, never on the
// other rows or the threads, so the result is what the row computes alone; the blocks are what lets the threads
// share one long row.
constexpr int64_t KEY_BLOCK = 512;
// Keys requested this many keys ahead of the one scored (2 KB of float32 keys): on the Xeon the attention of 1 / 4 / 8
// rows over 2,000 keys 12 / 9 / 5% cheaper than with the hardware's prefetcher alone, interleaved in one process
// (results/engine_kernels_xeon/kernel_ab/README.md). Values already come in as their keys are scored (requesting
// them into L2 instead, or not at all, was slower there). Where attention_requests_ahead() says so: not on the Zen 4.
constexpr int64_t KEY_AHEAD = 8;

inline int64_t blocks_of(int64_t visible) { return std::max<int64_t>(1, (visible + KEY_BLOCK - 1) / KEY_BLOCK); }

struct AttentionScratch {
  std::vector<float> scores;  // per head: scores, then exps, of the block's keys (VL of slack past each)
};

// Where a block's result goes: the row's output (the row is one block) or its partial, per head
// [largest score, sum of exps, weighted values (D floats)] at partial + head * partial_stride.
template <typename T>
struct BlockTarget {
  T* out;
  float* partial;
  int64_t partial_stride;
};

// The keys of `mask_row` above MASKED_BELOW, in cache order, into `visible`; returns how many.
inline int64_t compact_visible(const float* mask_row, int64_t length, int64_t* visible) {
  int64_t n = 0;
  for (int64_t j = 0; j < length; j += VL) {
    const int valid = int(std::min<int64_t>(VL, length - j));
    const uint32_t all = uint32_t((uint64_t(1) << valid) - 1);
    uint32_t bits = vvisible_bits(vload_partial(mask_row + j, valid)) & all;
    if (bits == all) {  // the common case: a run of visible keys
      for (int t = 0; t < valid; ++t) visible[n + t] = j + t;
      n += valid;
      continue;
    }
    for (; bits; bits &= bits - 1) visible[n++] = j + __builtin_ctz(bits);
  }
  return n;
}

// The largest of sc[0 .. n - 1] (-inf when n = 0); sc has VL floats of slack past n, which it overwrites.
inline float max_of(float* sc, int64_t n) {
  for (int t = 0; t < VL; ++t) sc[n + t] = -INFINITY;
  V best = vset1(-INFINITY);
  for (int64_t i = 0; i < n; i += VL) best = vmax(best, vload(sc + i));
  return vreduce_max(best);
}

// sc[0 .. n - 1] -> exp(sc - largest) in place; returns their sum.
inline float exps_in_place(float* sc, int64_t n, float largest) {
  V total = vzero();
  for (int64_t i = 0; i < n; i += VL) {
    const int valid = int(std::min<int64_t>(VL, n - i));
    V e = vmask_tail(vexp(vadd(vload_partial(sc + i, valid), vset1(-largest))), valid);
    vstore(sc + i, e);
    total = vadd(total, e);
  }
  return vreduce_add(total);
}

// A value row requested while its key is scored: weigh_run's sweeps then find every value in cache.
inline void prefetch_row(const void* row, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(static_cast<const char*>(row) + b, 0, 3);
}

// The value sums' tile: an accumulator per (row, head) for each of G chunks of the head_dim, the G chunks of a value,
// and the broadcast weight, all in registers (AVX2 has 16: 3 heads x 8 chunks of a 64-wide head took 24 and were
// stored and reloaded every key). weigh_run sweeps a run of VALUE_RUN keys (their values in L1 after the first sweep)
// once per G chunks, the accumulators kept in memory between runs. Each accumulator still sums its keys in order: the
// tile changes no bit of a result.
constexpr int VECTOR_REGISTERS = VL == 16 ? 32 : 16;
constexpr int64_t VALUE_RUN = 32;

constexpr int value_chunks(int sums, int chunks) {
  int g = chunks;
  while (g > 1 && ((sums + 1) * g + 1 > VECTOR_REGISTERS || chunks % g)) --g;
  return g;
}

// sum[j][c] += weights[j][i] times the chunk c of key i's value, for c = c0 .. c0 + G - 1 and the keys i = first ..
// last - 1 in order; j runs over SUMS (row, head) pairs.
template <int SUMS, int CHUNKS, int G, typename T>
void weigh_run(V (*sum)[CHUNKS], const T* values, int64_t value_stride, const int64_t* visible, int64_t first,
               int64_t last, const float* const* weights, int c0) {
  V acc[SUMS][G];  // (unrolled so GCC keeps the accumulators in registers, not stored every key)
#pragma GCC unroll 32
  for (int j = 0; j < SUMS; ++j)
#pragma GCC unroll 32
    for (int c = 0; c < G; ++c) acc[j][c] = sum[j][c0 + c];
  for (int64_t i = first; i < last; ++i) {
    const T* value = values + visible[i] * value_stride + c0 * VL;
    V loaded[G];
#pragma GCC unroll 32
    for (int c = 0; c < G; ++c) loaded[c] = load_row(value, c * VL, VL);
#pragma GCC unroll 32
    for (int j = 0; j < SUMS; ++j) {
      const V p = vset1(weights[j][i]);
#pragma GCC unroll 32
      for (int c = 0; c < G; ++c) acc[j][c] = vfma(p, loaded[c], acc[j][c]);
    }
  }
#pragma GCC unroll 32
  for (int j = 0; j < SUMS; ++j)
#pragma GCC unroll 32
    for (int c = 0; c < G; ++c) sum[j][c0 + c] = acc[j][c];
}

// sum[j] += the values of keys first .. last - 1 weighted by weights[j], for SUMS (row, head) pairs.
template <int SUMS, int CHUNKS, typename T>
void weigh_values(V (*sum)[CHUNKS], const T* values, int64_t value_stride, const int64_t* visible, int64_t first,
                  int64_t last, const float* const* weights) {
  constexpr int G = value_chunks(SUMS, CHUNKS);
  for (int64_t run = first; run < last; run += VALUE_RUN)
    for (int c0 = 0; c0 < CHUNKS; c0 += G)
      weigh_run<SUMS, CHUNKS, G>(sum, values, value_stride, visible, run, std::min(last, run + VALUE_RUN), weights,
                                 c0);
}

// One row of a task: its first query head's row, its mask row, the block's visible keys (n of them), and where the
// block's result goes.
template <typename T>
struct BlockRow {
  const T* q;
  const float* mask_row;
  const int64_t* visible;
  int64_t n;
  BlockTarget<T> target;
};

// One key's sums for every (row, head): lanes[r][h][t] = the sum over the head_dim's CHUNKS chunks of query times key,
// chunk after chunk (vreduce_each then adds its lanes). While it scores, the key's value and the key KEY_AHEAD on
// (`ahead`, null: none) are requested where attention_requests_ahead() says so.
template <int ROWS, int HEADS, int CHUNKS, typename T>
inline void score_key(const V (*query)[HEADS][CHUNKS], const T* key, const T* value, const T* ahead, bool request,
                      V (*lanes)[HEADS][VL], int t) {
  if (request) {
    prefetch_row(value, CHUNKS * VL * int64_t(sizeof(T)));
    if (ahead) prefetch_row(ahead, CHUNKS * VL * int64_t(sizeof(T)));
  }
  V loaded[CHUNKS];
#pragma GCC unroll 8
  for (int c = 0; c < CHUNKS; ++c) loaded[c] = load_row(key, c * VL, VL);
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 8
    for (int h = 0; h < HEADS; ++h) {
      V acc = vzero();
#pragma GCC unroll 8
      for (int c = 0; c < CHUNKS; ++c) acc = vfma(query[r][h][c], loaded[c], acc);
      lanes[r][h][t] = acc;
    }
}

// The scores of visible keys first_key .. last - 1 (the same keys for each of the ROWS rows) for HEADS query heads of
// each row, into scores[r * HEADS + h][i]: each key is loaded once for every row and head; VL keys' scores are reduced
// together, each by the same tree as alone, so a score is what its row computes alone. A whole group of VL keys is
// scored with its loop unrolled (AVX-512): on the Zen 4, 30 layers' attention of 1 / 8 / 16 rows over 256 cached keys
// at one thread 0.47-0.59 -> 0.42-0.44 / 2.51-2.96 -> 2.12-2.20 / 4.85-5.59 -> 4.04-4.13 ms, in six alternations of
// the two builds (results/engine_kernels_zen4/README.md); the same bits.
template <int ROWS, int HEADS, int CHUNKS, typename T>
void score_keys(const V (*query)[HEADS][CHUNKS], const BlockRow<T>* rows, const T* keys, int64_t key_stride,
                const T* values, int64_t value_stride, int64_t first_key, int64_t last, float scaling,
                float* const* scores) {
  const int64_t* visible = rows[0].visible;
  const bool request = attention_requests_ahead();
  auto key_of = [&](int64_t i) { return keys + visible[i] * key_stride; };
  auto ahead_of = [&](int64_t i) { return i + KEY_AHEAD < last ? key_of(i + KEY_AHEAD) : nullptr; };
  for (int64_t first = first_key; first < last; first += VL) {
    const int count = int(std::min<int64_t>(VL, last - first));
    V lanes[ROWS][HEADS][VL];
    if (VL == 16 && count == VL) {
#pragma GCC unroll 16
      for (int t = 0; t < VL; ++t)
        score_key<ROWS, HEADS, CHUNKS>(query, key_of(first + t), values + visible[first + t] * value_stride,
                                       ahead_of(first + t), request, lanes, t);
    } else {
      for (int t = 0; t < VL; ++t) {
        if (t < count) {
          score_key<ROWS, HEADS, CHUNKS>(query, key_of(first + t), values + visible[first + t] * value_stride,
                                         ahead_of(first + t), request, lanes, t);
          continue;
        }
        for (int r = 0; r < ROWS; ++r)
          for (int h = 0; h < HEADS; ++h) lanes[r][h][t] = vzero();
      }
    }
    for (int r = 0; r < ROWS; ++r) {
      alignas(64) float mask_values[VL] = {};
      for (int t = 0; t < count; ++t) mask_values[t] = rows[r].mask_row[visible[first + t]];
      const V mask_vector = vload(mask_values);
      for (int h = 0; h < HEADS; ++h)  // scores have VL slots of slack past each row's n
        vstore(scores[r * HEADS + h] + first, vfma(vreduce_each(lanes[r][h]), vset1(scaling), mask_vector));
    }
  }
}

// One block of ROWS rows whose first `shared` visible keys are the same (a verify's rows over the cached context), for
// HEADS query heads sharing one kv head, head_dim = CHUNKS * VL. The shared keys are scored and weighed for every row
// at once, each key and value loaded once for all of them; then each row's own keys. A row's scores, largest score,
// sum of exps and value sums (each over its keys in order) are what the row computes alone.
template <int ROWS, int HEADS, int CHUNKS, typename T>
void attend_rows(const BlockRow<T>* rows, int64_t shared, int64_t q_head_stride, const T* keys, const T* values,
                 int64_t key_stride, int64_t value_stride, float scaling, AttentionScratch& s) {
  constexpr int SUMS = ROWS * HEADS;
  int64_t stride = 0;
  for (int r = 0; r < ROWS; ++r) stride = std::max(stride, rows[r].n + VL);
  s.scores.resize(size_t(SUMS * stride));
  float* scores[SUMS];
  for (int j = 0; j < SUMS; ++j) scores[j] = s.scores.data() + j * stride;
  V query[ROWS][HEADS][CHUNKS];
  for (int r = 0; r < ROWS; ++r)
    for (int h = 0; h < HEADS; ++h)
      for (int c = 0; c < CHUNKS; ++c) query[r][h][c] = load_row(rows[r].q + h * q_head_stride, c * VL, VL);
  score_keys<ROWS, HEADS, CHUNKS>(query, rows, keys, key_stride, values, value_stride, 0, shared, scaling, scores);
  for (int r = 0; r < ROWS; ++r)
    score_keys<1, HEADS, CHUNKS>(query + r, rows + r, keys, key_stride, values, value_stride, shared, rows[r].n,
                                 scaling, scores + r * HEADS);
  float largest[SUMS], total[SUMS];
  for (int j = 0; j < SUMS; ++j) {
    largest[j] = max_of(scores[j], rows[j / HEADS].n);
    total[j] = exps_in_place(scores[j], rows[j / HEADS].n, largest[j]);
  }
  V sum[SUMS][CHUNKS];
  for (int j = 0; j < SUMS; ++j)
    for (int c = 0; c < CHUNKS; ++c) sum[j][c] = vzero();
  weigh_values<SUMS, CHUNKS>(sum, values, value_stride, rows[0].visible, 0, shared, scores);
  for (int r = 0; r < ROWS; ++r)
    weigh_values<HEADS, CHUNKS>(sum + r * HEADS, values, value_stride, rows[r].visible, shared, rows[r].n,
                                scores + r * HEADS);
  for (int j = 0; j < SUMS; ++j) {
    const BlockTarget<T>& target = rows[j / HEADS].target;
    const int h = j % HEADS;
    if (target.out) {
      const V inverse = vset1(rows[j / HEADS].n ? 1.0f / total[j] : 0.0f);
      for (int c = 0; c < CHUNKS; ++c)
        vstore_out(target.out + h * (CHUNKS * VL) + c * VL, vmul(sum[j][c], inverse), VL);
      continue;
    }
    float* partial = target.partial + h * target.partial_stride;
    partial[0] = largest[j];
    partial[1] = total[j];
    for (int c = 0; c < CHUNKS; ++c) vstore(partial + 2 + c * VL, sum[j][c]);
  }
}

// Any other shape (a head_dim that is not 64 or 128, more heads per kv head than the fixed paths take): one head,
// VL-wide chunks with a masked tail. Same blocks and order as attend_rows, so just as invariant.
template <typename T>
void attend_block_any(const T* q, const T* keys, const T* values, int64_t key_stride, int64_t value_stride,
                      const float* mask_row, const int64_t* visible, int64_t n, int64_t D, float scaling,
                      AttentionScratch& s, const BlockTarget<T>& target) {
  const int64_t chunks = (D + VL - 1) / VL;
  auto valid_of = [&](int64_t c) { return int(std::min<int64_t>(VL, D - c * VL)); };
  s.scores.resize(n + VL);
  for (int64_t i = 0; i < n; ++i) {
    const T* key = keys + visible[i] * key_stride;
    V acc = vzero();
    for (int64_t c = 0; c < chunks; ++c)
      acc = vfma(load_row(q, c * VL, valid_of(c)), load_row(key, c * VL, valid_of(c)), acc);
    s.scores[i] = vreduce_add(acc) * scaling + mask_row[visible[i]];
  }
  const float largest = max_of(s.scores.data(), n);
  const float total = exps_in_place(s.scores.data(), n, largest);
  for (int64_t c = 0; c < chunks; ++c) {
    V acc = vzero();
    for (int64_t i = 0; i < n; ++i)
      acc = vfma(vset1(s.scores[i]), load_row(values + visible[i] * value_stride, c * VL, valid_of(c)), acc);
    if (target.out) vstore_out(target.out + c * VL, vmul(acc, vset1(n ? 1.0f / total : 0.0f)), valid_of(c));
    else vstore_out(target.partial + 2 + c * VL, acc, valid_of(c));
  }
  if (!target.out) {
    target.partial[0] = largest;
    target.partial[1] = total;
  }
}

// A row's output from its blocks' partials (blocks >= 2), in block order: largest = the max of theirs, then
// sum of exps and weighted values each rescaled by exp(block's largest - largest) and added block by block.
template <typename T>
void combine_blocks(const float* partial, int64_t blocks, int64_t stride, int64_t D, T* out) {
  float largest = -INFINITY;
  for (int64_t b = 0; b < blocks; ++b) largest = std::max(largest, partial[b * stride]);
  const int64_t chunks = (D + VL - 1) / VL;
  std::vector<float> rescale(size_t(blocks), 0.0f);  // exp(block's largest - largest), once per block
  float total = 0.0f;
  for (int64_t b = 0; b < blocks; ++b) {
    alignas(64) float lanes[VL];
    vstore(lanes, vexp(vset1(partial[b * stride] - largest)));
    rescale[b] = lanes[0];
    total = std::fma(rescale[b], partial[b * stride + 1], total);
  }
  for (int64_t c = 0; c < chunks; ++c) {
    const int valid = int(std::min<int64_t>(VL, D - c * VL));
    V acc = vzero();
    for (int64_t b = 0; b < blocks; ++b)
      acc = vfma(vset1(rescale[b]), vload_partial(partial + b * stride + 2 + c * VL, valid), acc);
    vstore_out(out + c * VL, vmul(acc, vset1(1.0f / total)), valid);
  }
}

// The rows a task takes together on a fixed path: as many as fit the score tile's registers (a row's HEADS
// accumulators, the key's CHUNKS vectors), at most ATTENTION_ROWS. AVX2: two rows of 3 heads of 64 (6 + 8 of 16
// registers). AVX-512: up to four where avx512_attention_rows() says so (the Xeon), else one (batch_invariant.cpp).
constexpr int ATTENTION_ROWS = VL == 8 ? 2 : 4;

constexpr int rows_per_task(int heads, int chunks) {
  int rows = ATTENTION_ROWS;
  while (rows > 1 && rows * heads + chunks > VECTOR_REGISTERS - 1) --rows;
  return rows;
}

// `count` (<= ROWS) rows together (attend_rows), their first `shared` keys the same.
template <int ROWS, int HEADS, int CHUNKS, typename T>
void attend_group(const BlockRow<T>* rows, int count, int64_t shared, int64_t q_head_stride, const T* keys,
                  const T* values, int64_t key_stride, int64_t value_stride, float scaling, AttentionScratch& s) {
  if constexpr (ROWS > 1) {
    if (count < ROWS)
      return attend_group<ROWS - 1, HEADS, CHUNKS>(rows, count, shared, q_head_stride, keys, values, key_stride,
                                                   value_stride, scaling, s);
  }
  attend_rows<ROWS, HEADS, CHUNKS>(rows, shared, q_head_stride, keys, values, key_stride, value_stride, scaling, s);
}

template <int HEADS, int CHUNKS, typename T>
bool attend_fixed(int64_t heads, int64_t D, const BlockRow<T>* rows, int count, int64_t shared,
                  int64_t q_head_stride, const T* keys, const T* values, int64_t key_stride, int64_t value_stride,
                  float scaling, AttentionScratch& s) {
  if (heads != HEADS || D != CHUNKS * VL) return false;
  attend_group<rows_per_task(HEADS, CHUNKS), HEADS, CHUNKS>(rows, count, shared, q_head_stride, keys, values,
                                                            key_stride, value_stride, scaling, s);
  return true;
}

// Whether attend_any_shape takes `heads` heads of head_dim D together (else head by head, with attend_block_any's
// different order: so a task takes every head of its kv head only where this holds, whatever the rows), and how many
// rows a task takes together there.
inline bool has_fixed_path(int64_t heads, int64_t D) {
  return VL > 1 && ((D == 64 && heads <= 4) || (D == 128 && heads <= 2));
}

inline int fixed_path_rows(int64_t heads, int64_t D) {
  const int most = VL == 16 ? avx512_attention_rows() : ATTENTION_ROWS;
  return has_fixed_path(heads, D) ? std::min(most, rows_per_task(int(heads), int(D / VL))) : 1;
}

// One block of `count` rows (their first `shared` keys the same) for `heads` query heads of one kv head: a fixed path
// where the shape has one, else row by row and head by head.
template <typename T>
void attend_any_shape(int64_t heads, int64_t D, const BlockRow<T>* rows, int count, int64_t shared,
                      int64_t q_head_stride, const T* keys, const T* values, int64_t ks, int64_t vs, float scaling,
                      AttentionScratch& s) {
  if constexpr (VL > 1) {
    const auto args = std::forward_as_tuple(heads, D, rows, count, shared, q_head_stride, keys, values, ks, vs,
                                            scaling, s);
    if (std::apply(attend_fixed<1, 64 / VL, T>, args) || std::apply(attend_fixed<2, 64 / VL, T>, args) ||
        std::apply(attend_fixed<3, 64 / VL, T>, args) || std::apply(attend_fixed<4, 64 / VL, T>, args) ||
        std::apply(attend_fixed<1, 128 / VL, T>, args) || std::apply(attend_fixed<2, 128 / VL, T>, args))
      return;
  }
  for (int r = 0; r < count; ++r) {
    const BlockRow<T>& row = rows[r];
    for (int64_t h = 0; h < heads; ++h) {
      const BlockTarget<T> one{row.target.out ? row.target.out + h * D : nullptr,
                               row.target.partial ? row.target.partial + h * row.target.partial_stride : nullptr, 0};
      attend_block_any(row.q + h * q_head_stride, keys, values, ks, vs, row.mask_row, row.visible, row.n, D, scaling,
                       s, one);
    }
  }
}

// How many of the first keys of rows[0 .. count - 1] are the same.
template <typename T>
int64_t shared_keys(const BlockRow<T>* rows, int count) {
  int64_t shared = rows[0].n;
  for (int r = 1; r < count; ++r) {
    int64_t i = 0;
    const int64_t most = std::min(shared, rows[r].n);
    while (i < most && rows[r].visible[i] == rows[0].visible[i]) ++i;
    shared = i;
  }
  return shared;
}

struct AttentionTask {
  int64_t b, g, row, rows, head_block, block;
};


// q (B, Hq, W, D), keys/values (B, Hkv, C, D) (last axis contiguous), mask (B or 1, 1, W, >= C) float32;
// out (B, W, Hq, D) contiguous. First each row's visible keys; then tasks (batch, kv head, rows, head block, key
// block), a head block being every query head of the kv head (one head where that leaves fewer tasks than the
// threads, or where the shape has no fixed path for them together), and the rows a group of consecutive rows on a
// fixed path (fixed_path_rows; halved while the groups, times the longest row's key blocks, would leave fewer than
// two tasks a thread); then the rows of more than one key block combine their partials.
template <typename T>
void attention_kernel(const T* q, const int64_t* q_strides, const T* k, const T* v, const int64_t* kv_strides,
                      const float* mask, const int64_t* mask_strides, int64_t B, int64_t Hq, int64_t Hkv, int64_t W,
                      int64_t C, int64_t D, float scaling, T* out) {
  const int64_t groups = Hq / Hkv, threads = omp_get_max_threads(), rows = B * W;
  std::unique_ptr<int64_t[]> visible(new int64_t[size_t(rows * C)]);  // (not zeroed: each row writes its own)
  std::vector<int64_t> counts(static_cast<size_t>(rows));
#pragma omp parallel for schedule(static) if (rows > 1)
  for (int64_t r = 0; r < rows; ++r)
    counts[r] = compact_visible(mask + (r / W) * mask_strides[0] + (r % W) * mask_strides[2], C, visible.get() + r * C);
  int64_t most_blocks = 1, grouped_tasks = 0;
  for (int64_t r = 0; r < rows; ++r) {
    most_blocks = std::max(most_blocks, blocks_of(counts[r]));
    grouped_tasks += Hkv * blocks_of(counts[r]);
  }
  const int64_t head_blocks = grouped_tasks >= threads && has_fixed_path(groups, D) ? 1 : groups;
  const int64_t heads = groups / head_blocks;
  int64_t task_rows = head_blocks == 1 ? fixed_path_rows(groups, D) : 1;
  while (task_rows > 1 && B * Hkv * ((W + task_rows - 1) / task_rows) * most_blocks < 2 * threads)
    task_rows = (task_rows + 1) / 2;
  std::vector<AttentionTask> tasks;
  tasks.reserve(size_t(grouped_tasks * head_blocks));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t g = 0; g < Hkv; ++g)
      for (int64_t row = 0; row < W; row += task_rows)
        for (int64_t hb = 0; hb < head_blocks; ++hb) {
          const int64_t last_row = std::min(W, row + task_rows);
          int64_t blocks = 1;
          for (int64_t r = row; r < last_row; ++r) blocks = std::max(blocks, blocks_of(counts[b * W + r]));
          for (int64_t block = 0; block < blocks; ++block) tasks.push_back({b, g, row, last_row - row, hb, block});
        }
  const int64_t partial_stride = D + 2;  // per (row, head, block)
  std::vector<float> partials(most_blocks > 1 ? size_t(rows * Hq * most_blocks * partial_stride) : 0);
  auto partial_of = [&](int64_t r, int64_t head, int64_t block) {
    return partials.data() + ((r * Hq + head) * most_blocks + block) * partial_stride;
  };
#pragma omp parallel if (tasks.size() > 1)
  {
    AttentionScratch scratch;
#pragma omp for schedule(dynamic)
    for (int64_t i = 0; i < int64_t(tasks.size()); ++i) {
      const AttentionTask& t = tasks[size_t(i)];
      const int64_t first_head = t.g * groups + t.head_block * heads, first = t.block * KEY_BLOCK;
      BlockRow<T> block_rows[ATTENTION_ROWS];  // (rows_per_task <= ATTENTION_ROWS)
      int count = 0;
      for (int64_t row = t.row; row < t.row + t.rows; ++row) {
        const int64_t r = t.b * W + row, n = counts[r];
        if (t.block >= blocks_of(n)) continue;  // a shorter row of the group
        const bool whole = blocks_of(n) == 1;
        block_rows[count++] = {q + t.b * q_strides[0] + first_head * q_strides[1] + row * q_strides[2],
                               mask + t.b * mask_strides[0] + row * mask_strides[2], visible.get() + r * C + first,
                               std::min(KEY_BLOCK, n - first),  // >= 0
                               {whole ? out + (r * Hq + first_head) * D : nullptr,
                                whole ? nullptr : partial_of(r, first_head, t.block), most_blocks * partial_stride}};
      }
      attend_any_shape(heads, D, block_rows, count, shared_keys(block_rows, count), q_strides[1],
                       k + t.b * kv_strides[0] + t.g * kv_strides[1], v + t.b * kv_strides[4] + t.g * kv_strides[5],
                       kv_strides[2], kv_strides[6], scaling, scratch);
    }
  }
  if (most_blocks == 1) return;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < rows * Hq; ++i) {
    const int64_t r = i / Hq, head = i % Hq;
    if (blocks_of(counts[r]) > 1)
      combine_blocks(partial_of(r, head, 0), blocks_of(counts[r]), partial_stride, D, out + (r * Hq + head) * D);
  }
}

// ---- The greedy head: approximate logits, then exactly those that could be the largest -------------------------
// A row's approximate logits (`a`, N: from int8 weights, `scale` their scales, or from bfloat16 weights and inputs) are
// each within
//   bound_j = scale[j] * reach + |a[j]| * HEAD_SLACK + HEAD_FLOOR
// of the exact logit, where reach = sum_k |x_k| times the error constant (kernels.py's GreedyHead says why). Every
// column whose upper bound a[j] + bound_j reaches the largest lower bound max_j (a[j] - bound_j) may hold the exact
// maximum; each of them is recomputed in float64, the inputs in order (the same value whatever else the row holds).
// The other columns keep a[j], below the exact maximum: the row's argmax is the exact logits' argmax.
constexpr float HEAD_SLACK = 1.0f / (1 << 20);  // covers the float rounding of a[j] +- bound_j
constexpr float HEAD_FLOOR = 1e-30f;  // covers inputs or products flushed to zero (denormals)

inline V head_bound(V a, V scale, V reach) {
  return vadd(vadd(vmul(scale, reach), vmul(vmax(a, vmul(a, vset1(-1.0f))), vset1(HEAD_SLACK))), vset1(HEAD_FLOOR));
}
inline float head_bound_one(float a, float scale, float reach) {
  return scale * reach + std::fabs(a) * HEAD_SLACK + HEAD_FLOOR;
}

inline float largest_lower_bound(const float* a, const float* scale, float reach, int64_t N) {
  const V vreach = vset1(reach), minus = vset1(-1.0f);
  V best = vset1(-INFINITY);
  int64_t j = 0;
  for (; j + VL <= N; j += VL) {
    const V value = vload(a + j);
    best = vmax(best, vadd(value, vmul(head_bound(value, vload(scale + j), vreach), minus)));
  }
  float lowest = vreduce_max(best);
  for (; j < N; ++j) lowest = std::max(lowest, a[j] - head_bound_one(a[j], scale[j], reach));
  return lowest;
}

inline void head_candidates(const float* a, const float* scale, float reach, float lowest, int64_t N,
                            std::vector<int64_t>& columns) {
  const V vreach = vset1(reach), vlowest = vset1(lowest);
  int64_t j = 0;
  for (; j + VL <= N; j += VL) {
    const V value = vload(a + j);
    for (uint32_t bits = vat_least_bits(vadd(value, head_bound(value, vload(scale + j), vreach)), vlowest); bits;
         bits &= bits - 1)
      columns.push_back(j + __builtin_ctz(bits));
  }
  for (; j < N; ++j)
    if (a[j] + head_bound_one(a[j], scale[j], reach) >= lowest) columns.push_back(j);
}

// x . w in float64: lane l of DOT_LANES sums the products of inputs l, l + DOT_LANES, ... in order (each product and
// sum rounded alone: the build does not contract them), then the lanes in a fixed tree. Every instruction set
// computes the same value (the lanes are independent: a vectorised loop does the same operations).
constexpr int DOT_LANES = 8;
template <typename T>
inline double exact_dot(const T* x, const T* w, int64_t K) {
  double lane[DOT_LANES] = {};
  int64_t k = 0;
  for (; k + DOT_LANES <= K; k += DOT_LANES)
    for (int l = 0; l < DOT_LANES; ++l) lane[l] += double(x_value(x, k + l)) * double(x_value(w, k + l));
  for (int l = 0; k < K; ++k, ++l) lane[l] += double(x_value(x, k)) * double(x_value(w, k));
  for (int width = DOT_LANES / 2; width > 0; width /= 2)
    for (int l = 0; l < width; ++l) lane[l] += lane[l + width];
  return lane[0];
}

// out (M, N) holds the approximate logits of x (M, K); each row's candidates are replaced by their exact values.
// `error` is the approximation's error constant (a bound on |exact - a[j]| over scale[j] * sum |x|); `extra` (null:
// none) a reach per row added to sum |x| * error (a bound's term that does not scale with sum |x|).
template <typename T>
void greedy_head_rows(const T* x, int64_t M, int64_t K, const T* weight, int64_t N, const float* scale, double error,
                      const float* extra, float* out) {
#pragma omp parallel for schedule(static) if (M > 1)
  for (int64_t m = 0; m < M; ++m) {
    const T* row_x = x + m * K;
    float* row = out + m * N;
    double l1 = 0.0;
    for (int64_t k = 0; k < K; ++k) l1 += std::fabs(double(x_value(row_x, k)));
    const double more = extra ? double(extra[m]) : 0.0;
    const float reach = float((l1 * error + more) * (1.0 + 1.0 / (1 << 20)));  // rounded up, with room
    std::vector<int64_t> columns;
    head_candidates(row, scale, reach, largest_lower_bound(row, scale, reach, N), N, columns);
    for (int64_t j : columns) row[j] = float(exact_dot(row_x, weight + j * K, K));
  }
}

// ---- argmax -------------------------------------------------------------------------------------------------------
// The index of the largest of x[0 .. n - 1] (n >= 1), the first of equal ones, or of the first NaN where any: what
// torch.argmax picks. One pass finds the largest (or a NaN), one where it first lies. torch's own argmax compares
// element by element: ~120 us a row over SmolLM2's 49,152 logits on the Xeon, a tenth of the greedy head's 1.1 ms
// for one row (results/engine_kernels_xeon/argmax).
inline int64_t argmax_of(const float* x, int64_t n) {
  constexpr uint32_t ALL = uint32_t((uint64_t(1) << VL) - 1);
  const int64_t whole = n / VL * VL;
  V best = vset1(-INFINITY);
  for (int64_t j = 0; j < whole; j += VL) {
    const V v = vload(x + j);
    const uint32_t ordered = vat_least_bits(v, v);  // a lane is unordered with itself only where it is NaN
    if (ordered != ALL) return j + __builtin_ctz(~ordered);
    best = vmax(best, v);
  }
  float largest = vreduce_max(best);
  for (int64_t j = whole; j < n; ++j) {
    if (std::isnan(x[j])) return j;
    largest = std::max(largest, x[j]);
  }
  const V at_least = vset1(largest);
  for (int64_t j = 0; j < whole; j += VL)
    if (const uint32_t bits = vat_least_bits(vload(x + j), at_least)) return j + __builtin_ctz(bits);
  for (int64_t j = whole; j < n; ++j)
    if (x[j] >= largest) return j;
  return 0;  // (not reached: some element is the largest)
}

// out[m] = argmax_of(row m of x (M, N)).
inline void argmax_rows(const float* x, int64_t M, int64_t N, int64_t* out) {
#pragma omp parallel for schedule(static) if (M * N >= (int64_t(1) << 18))
  for (int64_t m = 0; m < M; ++m) out[m] = argmax_of(x + m * N, N);
}

// ---- a draft tree's top log-probabilities ---------------------------------------------------------------------------
// A drafter's next-token logits (a row of N, finite) -> its k most likely tokens as log-probabilities (x -
// logsumexp(x)), best first (equal values: the lower index first), and the log of their total probability: what
// torch.log_softmax, torch.topk and torch.logsumexp give in three ops a tree level (each cold after a forward has
// streamed the weights past the caches: ~0.2 ms a level together on the AVX2 EPYC), in one pass of a few kilobytes
// of code.
struct TopBuffer {
  std::vector<float> values;
  std::vector<int64_t> indices;
  int k, count = 0;
  explicit TopBuffer(int k) : values(size_t(k)), indices(size_t(k)), k(k) {}

  // The k-th value so far (-inf while fewer than k): a value must exceed it to enter.
  float floor() const { return count < k ? -INFINITY : values[size_t(k - 1)]; }

  void offer(float value, int64_t index) {  // index increasing from call to call
    if (std::isnan(value) || (count == k && !(value > values[size_t(k - 1)]))) return;
    int at = count < k ? count++ : k - 1;
    for (; at > 0 && values[size_t(at - 1)] < value; --at) {  // after the equal ones (lower indices)
      values[size_t(at)] = values[size_t(at - 1)];
      indices[size_t(at)] = indices[size_t(at - 1)];
    }
    values[size_t(at)] = value;
    indices[size_t(at)] = index;
  }
};

inline double log_sum_exp(const float* x, int64_t N) {
  V best = vset1(-INFINITY);
  int64_t j = 0;
  for (; j + VL <= N; j += VL) best = vmax(best, vload(x + j));
  float largest = vreduce_max(best);
  for (; j < N; ++j) largest = std::max(largest, x[j]);
  V total = vzero();
  for (j = 0; j + VL <= N; j += VL) total = vadd(total, vexp(vadd(vload(x + j), vset1(-largest))));
  double sum = vreduce_add(total);
  for (; j < N; ++j) sum += std::exp(double(x[j]) - double(largest));
  return double(largest) + std::log(sum);
}

inline void top_log_probs_row(const float* x, int64_t N, int k, float* values, int64_t* indices, double* share) {
  const double lse = log_sum_exp(x, N);
  TopBuffer top(k);
  int64_t j = 0;
  for (; j + VL <= N; j += VL) {
    uint32_t bits = vat_least_bits(vload(x + j), vset1(top.floor()));  // (NaN never)
    for (; bits; bits &= bits - 1) {
      const int64_t index = j + __builtin_ctz(bits);
      top.offer(x[index], index);
    }
  }
  for (; j < N; ++j) top.offer(x[j], j);
  for (int i = top.count; i < k; ++i) top.values[size_t(i)] = NAN, top.indices[size_t(i)] = 0;  // (NaN rows)
  double total = 0.0;
  for (int i = 0; i < k; ++i) {
    const double log_prob = double(top.values[size_t(i)]) - lse;
    values[i] = float(log_prob);
    indices[i] = top.indices[size_t(i)];
    total += std::exp(log_prob);
  }
  *share = std::log(total);
}

// Rows of x (M, N), k <= N: values (M, k), indices (M, k), share (M).
inline void top_log_probs_rows(const float* x, int64_t M, int64_t N, int k, float* values, int64_t* indices,
                               double* share) {
  for (int64_t m = 0; m < M; ++m) top_log_probs_row(x + m * N, N, k, values + m * k, indices + m * k, share + m);
}
