// The kernels of batch_invariant.cpp, written once over a small vector vocabulary and compiled once per
// instruction set (batch_invariant.cpp includes this file inside a namespace and a `#pragma GCC target`).
//
// Before including, the including namespace defines: VL (lanes), V (a float vector), vzero, vset1, vload,
// vload_partial, vmask_tail, vstore, vstore_out (float or bf16, the first n lanes), vfma, vmul, vadd, vmax,
// vreduce_add, vreduce_each (vreduce_add of VL vectors at once, bit for bit), vreduce_max, vvisible_bits (lanes
// above MASKED_BELOW), vload_i8 (int8 -> floats), vload_bf16_partial, vload_bf16_pairs, vexp, and DPBF16 (1 where a bf16 pair dot exists: vdpbf16).
//
// Batch invariance: every output element is reduced by the same sequence of operations whatever the number of
// rows, the thread count, and (for attention) wherever its visible keys lie in the cache.

constexpr int PANEL = 48;  // output columns per packed weight panel (kernels.py's PANEL)
constexpr int PANEL_VECTORS = PANEL / VL;
// The register tile: TILE_ROWS rows x TILE_VECTORS vectors of accumulators (AVX-512: 9 x 3 of 32 registers, so a
// verify of up to 9 rows streams each weight once, in one pass; AVX2: 3 x 3 of 16).
constexpr int TILE_VECTORS = VL == 1 ? 4 : 3;
constexpr int TILE_ROWS = VL == 16 ? 9 : VL == 8 ? 3 : 2;

inline float x_value(const float* x, int64_t i) { return x[i]; }
inline float x_value(const uint16_t* x, int64_t i) { return bf16_to_float(x[i]); }

// Every accumulator: acc = fma(x[m, k], w[k, n], acc) for k = 0, 1, ..., K - 1 (bf16 pairs: k even, then odd, or
// one bf16 dot per pair), whatever tile it sits in. Weight panels: float32 / int8 (panels, K, 64); bf16 as pairs
// (panels, K/2, 64, 2).
inline V load_weight(const float* p) { return vload(p); }
inline V load_weight(const int8_t* p) { return vload_i8(p); }  // exact: int8 -> float

template <int MB, int NV, typename XT, typename WT>
inline void tile_fma(const XT* x, int64_t ldx, const WT* panel, int64_t K, int c0, V acc[MB][NV]) {
  for (int64_t k = 0; k < K; ++k) {
    const WT* w = panel + k * PANEL + c0;
    V wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = load_weight(w + v * VL);
    for (int m = 0; m < MB; ++m) {
      V xb = vset1(x_value(x, m * ldx + k));
      for (int v = 0; v < NV; ++v) acc[m][v] = vfma(xb, wv[v], acc[m][v]);
    }
  }
}

template <int MB, int NV>
inline void tile_bf16(const uint16_t* x, int64_t ldx, const uint16_t* panel, int64_t K, int c0, V acc[MB][NV]) {
  const int64_t pairs = (K + 1) / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    const uint16_t* w = panel + (p * PANEL + c0) * 2;
    for (int m = 0; m < MB; ++m) {
      const uint16_t* xr = x + m * ldx + 2 * p;
      uint16_t second = (2 * p + 1 < K) ? xr[1] : 0;
#if DPBF16
      uint32_t pair = uint32_t(xr[0]) | (uint32_t(second) << 16);
      for (int v = 0; v < NV; ++v) acc[m][v] = vdpbf16(acc[m][v], pair, w + 2 * v * VL);
#else
      V x0 = vset1(bf16_to_float(xr[0])), x1 = vset1(bf16_to_float(second));
      for (int v = 0; v < NV; ++v) {
        V w0, w1;
        vload_bf16_pairs(w + 2 * v * VL, &w0, &w1);
        acc[m][v] = vfma(x1, w1, vfma(x0, w0, acc[m][v]));
      }
#endif
    }
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
                 const float* scale, const float* bias) {
  V acc[MB][NV];
  for (int m = 0; m < MB; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = vzero();
  if constexpr (std::is_same_v<WT, uint16_t>) tile_bf16<MB, NV>(x, K, panel, K, c0, acc);
  else tile_fma<MB, NV>(x, K, panel, K, c0, acc);
  for (int m = 0; m < MB; ++m) store_row<NV>(out + m * N, acc[m], column, N, scale, bias);
}

// Rows m .. m + rows - 1 (rows <= ROWS) of the columns c0 .. c0 + NV * VL - 1 of one panel.
template <int NV, int ROWS, typename XT, typename WT, typename OT>
inline void tile_rows(int64_t rows, const XT* x, int64_t K, const WT* panel, int c0, OT* out, int64_t column,
                      int64_t N, const float* scale, const float* bias) {
  if constexpr (ROWS >= 1) {
    if (rows == ROWS) return tile<ROWS, NV>(x, K, panel, c0, out, column, N, scale, bias);
    tile_rows<NV, ROWS - 1>(rows, x, K, panel, c0, out, column, N, scale, bias);
  }
}

// One task: `NV` vectors of columns of one panel, for every row, in passes of near-equal row counts <= ROWS.
template <int NV, int ROWS, typename XT, typename WT, typename OT>
inline void panel_task(const XT* x, int64_t M, int64_t K, const WT* panel, int c0, OT* out, int64_t column,
                       int64_t N, const float* scale, const float* bias) {
  const int64_t passes = (M + ROWS - 1) / ROWS;
  for (int64_t pass = 0, m = 0; pass < passes; ++pass) {
    const int64_t rows = (M - m) / (passes - pass);
    tile_rows<NV, ROWS>(rows, x + m * K, K, panel, c0, out + m * N, column, N, scale, bias);
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
  const int64_t subs = PANEL_VECTORS / TILE_VECTORS;
  const int64_t tasks = panels * subs;
#pragma omp parallel for schedule(static) if (tasks > 1)
  for (int64_t task = 0; task < tasks; ++task) {
    const int64_t p = task / subs;
    const int c0 = int(task % subs * TILE_VECTORS * VL);
    panel_task<TILE_VECTORS, TILE_ROWS>(x, M, K, packed + p * panel_size, c0, out, p * PANEL + c0, N, scale, bias);
  }
}

// ---- attention ------------------------------------------------------------------------------------------------

template <typename T>
inline V load_row(const T* p, int64_t d, int valid) {
  if constexpr (std::is_same_v<T, float>) return vload_partial(p + d, valid);
  else return vload_bf16_partial(p + d, valid);
}

// One query row of one head: softmax(q.K_visible * scale + mask) . V_visible, the visible keys taken in cache order
// and compacted, so where they lie (a tree's scattered ancestors, a chain's contiguous slots) changes nothing.
struct AttentionScratch {
  std::vector<int64_t> visible;  // the keys a row sees, in cache order (the first compact_visible(...) entries)
  std::vector<float> scores;     // per head: scores, then probabilities, of the visible keys
};

// The keys of `mask_row` above MASKED_BELOW, in cache order, into s.visible; returns how many.
inline int64_t compact_visible(const float* mask_row, int64_t length, AttentionScratch& s) {
  if (int64_t(s.visible.size()) < length) s.visible.resize(size_t(length));
  int64_t* visible = s.visible.data();
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

// One query row and HEADS query heads sharing one kv head, head_dim = CHUNKS * VL: each visible key and value is
// loaded once for the heads; every head reduces over the row's visible keys in cache order with the same
// instructions whatever the block, so the result is what the row computes alone, wherever its keys lie.
template <int HEADS, int CHUNKS, typename T>
void attend_row(const T* q_row, int64_t q_head_stride, const T* keys, const T* values, int64_t key_stride,
                int64_t value_stride, const float* mask_row, int64_t length, float scaling, AttentionScratch& s,
                T* out_row) {
  const int64_t n = compact_visible(mask_row, length, s), stride = n + VL;
  s.scores.resize(size_t(HEADS) * stride);
  V query[HEADS][CHUNKS];
  for (int h = 0; h < HEADS; ++h)
    for (int c = 0; c < CHUNKS; ++c) query[h][c] = load_row(q_row + h * q_head_stride, c * VL, VL);
  for (int64_t first = 0; first < n; first += VL) {  // VL keys at a time: their lane sums reduced together
    const int block = int(std::min<int64_t>(VL, n - first));
    V lanes[HEADS][VL];
    alignas(64) float mask_values[VL] = {};
    for (int t = 0; t < VL; ++t) {
      V acc[HEADS];
      for (int h = 0; h < HEADS; ++h) acc[h] = vzero();
      if (t < block) {
        const int64_t j = s.visible[first + t];
        const T* key = keys + j * key_stride;
        mask_values[t] = mask_row[j];
        V loaded[CHUNKS];
        for (int c = 0; c < CHUNKS; ++c) loaded[c] = load_row(key, c * VL, VL);
        for (int c = 0; c < CHUNKS; ++c)
          for (int h = 0; h < HEADS; ++h) acc[h] = vfma(query[h][c], loaded[c], acc[h]);
      }
      for (int h = 0; h < HEADS; ++h) lanes[h][t] = acc[h];
    }
    const V mask_vector = vload(mask_values);
    for (int h = 0; h < HEADS; ++h)  // scores has VL slots of slack past n
      vstore(s.scores.data() + h * stride + first, vfma(vreduce_each(lanes[h]), vset1(scaling), mask_vector));
  }
  float inverse[HEADS];
  for (int h = 0; h < HEADS; ++h) {
    float* sc = s.scores.data() + h * stride;
    const float maximum = max_of(sc, n);
    V total = vzero();
    for (int64_t i = 0; i < n; i += VL) {
      const int valid = int(std::min<int64_t>(VL, n - i));
      V e = vmask_tail(vexp(vadd(vload_partial(sc + i, valid), vset1(-maximum))), valid);
      vstore(sc + i, e);
      total = vadd(total, e);
    }
    inverse[h] = n ? 1.0f / vreduce_add(total) : 0.0f;
  }
  V sum[HEADS][CHUNKS];
#pragma GCC unroll 32
  for (int h = 0; h < HEADS; ++h)
#pragma GCC unroll 32
    for (int c = 0; c < CHUNKS; ++c) sum[h][c] = vzero();
  for (int64_t i = 0; i < n; ++i) {
    const T* value = values + s.visible[i] * value_stride;
    V loaded[CHUNKS];
#pragma GCC unroll 32
    for (int c = 0; c < CHUNKS; ++c) loaded[c] = load_row(value, c * VL, VL);
#pragma GCC unroll 32
    for (int h = 0; h < HEADS; ++h) {
      V p = vset1(s.scores[h * stride + i]);
#pragma GCC unroll 32
      for (int c = 0; c < CHUNKS; ++c) sum[h][c] = vfma(p, loaded[c], sum[h][c]);
    }
  }
#pragma GCC unroll 32
  for (int h = 0; h < HEADS; ++h)
#pragma GCC unroll 32
    for (int c = 0; c < CHUNKS; ++c) vstore_out(out_row + h * (CHUNKS * VL) + c * VL, vmul(sum[h][c], vset1(inverse[h])), VL);
}

// Any other shape (a head_dim that is not 64 or 128, more heads per kv head than the fixed paths take): one head
// of one row, VL-wide chunks with a masked tail. Same compaction and order as attend_row, so just as invariant.
template <typename T>
void attend_row_any(const T* q, const T* keys, const T* values, int64_t key_stride, int64_t value_stride,
                    const float* mask_row, int64_t length, int64_t D, float scaling, AttentionScratch& s, T* out) {
  const int64_t n = compact_visible(mask_row, length, s), chunks = (D + VL - 1) / VL;
  auto valid_of = [&](int64_t c) { return int(std::min<int64_t>(VL, D - c * VL)); };
  s.scores.resize(n + VL);
  float maximum = -INFINITY;
  for (int64_t i = 0; i < n; ++i) {
    const T* key = keys + s.visible[i] * key_stride;
    V acc = vzero();
    for (int64_t c = 0; c < chunks; ++c) acc = vfma(load_row(q, c * VL, valid_of(c)), load_row(key, c * VL, valid_of(c)), acc);
    s.scores[i] = vreduce_add(acc) * scaling + mask_row[s.visible[i]];
    maximum = std::max(maximum, s.scores[i]);
  }
  V total = vzero();
  for (int64_t i = 0; i < n; i += VL) {
    const int valid = int(std::min<int64_t>(VL, n - i));
    V e = vmask_tail(vexp(vadd(vload_partial(s.scores.data() + i, valid), vset1(-maximum))), valid);
    vstore(s.scores.data() + i, e);
    total = vadd(total, e);
  }
  const float inverse = n ? 1.0f / vreduce_add(total) : 0.0f;
  for (int64_t c = 0; c < chunks; ++c) {
    V acc = vzero();
    for (int64_t i = 0; i < n; ++i)
      acc = vfma(vset1(s.scores[i]), load_row(values + s.visible[i] * value_stride, c * VL, valid_of(c)), acc);
    vstore_out(out + c * VL, vmul(acc, vset1(inverse)), valid_of(c));
  }
}

template <int HEADS, int CHUNKS, typename T>
bool attend_fixed(int64_t heads, int64_t D, const T* q_row, int64_t q_head_stride, const T* keys, const T* values,
                  int64_t key_stride, int64_t value_stride, const float* mask_row, int64_t length, float scaling,
                  AttentionScratch& s, T* out_row) {
  if (heads != HEADS || D != CHUNKS * VL) return false;
  attend_row<HEADS, CHUNKS>(q_row, q_head_stride, keys, values, key_stride, value_stride, mask_row, length, scaling,
                            s, out_row);
  return true;
}

// q (B, Hq, W, D), keys/values (B, Hkv, C, D) (last axis contiguous), mask (B or 1, 1, W, >= C) float32;
// out (B, W, Hq, D) contiguous. Tasks: (batch, kv head, row, head block); a block is every query head of the kv
// head (one head where that leaves fewer tasks than twice the threads, or for shapes without a fixed path).
template <typename T>
void attention_kernel(const T* q, const int64_t* q_strides, const T* k, const T* v, const int64_t* kv_strides,
                      const float* mask, const int64_t* mask_strides, int64_t B, int64_t Hq, int64_t Hkv, int64_t W,
                      int64_t C, int64_t D, float scaling, T* out) {
  const int64_t groups = Hq / Hkv, threads = omp_get_max_threads();
  const int64_t head_blocks = (B * Hkv * W >= threads && groups <= 4 && D % VL == 0 && D / VL <= 8) ? 1 : groups;
  const int64_t heads = groups / head_blocks, tasks = B * Hkv * W * head_blocks;
#pragma omp parallel if (tasks > 1)
  {
    AttentionScratch scratch;
    scratch.visible.reserve(C);
#pragma omp for schedule(static)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t hb = task % head_blocks, row = (task / head_blocks) % W;
      const int64_t g = (task / (head_blocks * W)) % Hkv, b = task / (head_blocks * W * Hkv);
      const int64_t first_head = g * groups + hb * heads;
      const T* q_row = q + b * q_strides[0] + first_head * q_strides[1] + row * q_strides[2];
      const T* keys = k + b * kv_strides[0] + g * kv_strides[1];
      const T* values = v + b * kv_strides[4] + g * kv_strides[5];
      const float* mask_row = mask + b * mask_strides[0] + row * mask_strides[2];
      T* out_row = out + ((b * W + row) * Hq + first_head) * D;
      const int64_t ks = kv_strides[2], vs = kv_strides[6];
      bool done = false;
      if constexpr (VL > 1) {
        done = attend_fixed<1, 64 / VL>(heads, D, q_row, q_strides[1], keys, values, ks, vs, mask_row, C, scaling,
                                        scratch, out_row) ||
               attend_fixed<2, 64 / VL>(heads, D, q_row, q_strides[1], keys, values, ks, vs, mask_row, C, scaling,
                                        scratch, out_row) ||
               attend_fixed<3, 64 / VL>(heads, D, q_row, q_strides[1], keys, values, ks, vs, mask_row, C, scaling,
                                        scratch, out_row) ||
               attend_fixed<4, 64 / VL>(heads, D, q_row, q_strides[1], keys, values, ks, vs, mask_row, C, scaling,
                                        scratch, out_row) ||
               attend_fixed<1, 128 / VL>(heads, D, q_row, q_strides[1], keys, values, ks, vs, mask_row, C, scaling,
                                         scratch, out_row) ||
               attend_fixed<2, 128 / VL>(heads, D, q_row, q_strides[1], keys, values, ks, vs, mask_row, C, scaling,
                                         scratch, out_row);
      }
      if (!done)
        for (int64_t h = 0; h < heads; ++h)
          attend_row_any(q_row + h * q_strides[1], keys, values, ks, vs, mask_row, C, D, scaling, scratch,
                         out_row + h * D);
    }
  }
}
