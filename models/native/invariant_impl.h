// The kernels of batch_invariant.cpp, written once over a small vector vocabulary and compiled once per
// instruction set (batch_invariant.cpp includes this file inside a namespace and a `#pragma GCC target`).
//
// Before including, the including namespace defines: VL (lanes), V (a float vector), vzero, vset1, vload,
// vload_partial, vstore, vstore_partial, vfma, vmul, vadd, vmax, vreduce_add, vreduce_max, vload_bf16
// (8/16 bf16 -> floats), vload_i8 (int8 -> floats), vexp, and DPBF16 (1 where a bf16 pair dot exists: vdpbf16).
//
// Batch invariance: every output element is reduced by the same sequence of operations whatever the number of
// rows, the thread count, and (for attention) wherever its visible keys lie in the cache.

constexpr int PANEL = 64;              // output columns per packed weight panel
constexpr int PANEL_VECTORS = PANEL / VL;
constexpr int SUB_VECTORS = 4;         // vectors of one register tile (AVX-512: the whole panel)
constexpr int ROW_TILE = VL == 16 ? 6 : 2;  // rows of one register tile (6 x 4 accumulators of 32 registers)

inline float x_value(const float* x, int64_t i) { return x[i]; }
inline float x_value(const uint16_t* x, int64_t i) { return bf16_to_float(x[i]); }

// Weight panels: float32 / int8 (panels, K, 64); bf16 pairs (panels, K/2, 64, 2).
template <int MB, typename XT>
inline void tile_f32(const XT* x, int64_t ldx, const float* panel, int64_t K, int c0, V acc[MB][SUB_VECTORS]) {
  for (int64_t k = 0; k < K; ++k) {
    const float* w = panel + k * PANEL + c0;
    V wv[SUB_VECTORS];
    for (int v = 0; v < SUB_VECTORS; ++v) wv[v] = vload(w + v * VL);
    for (int m = 0; m < MB; ++m) {
      V xb = vset1(x_value(x, m * ldx + k));
      for (int v = 0; v < SUB_VECTORS; ++v) acc[m][v] = vfma(xb, wv[v], acc[m][v]);
    }
  }
}

template <int MB, typename XT>
inline void tile_i8(const XT* x, int64_t ldx, const int8_t* panel, int64_t K, int c0, V acc[MB][SUB_VECTORS]) {
  for (int64_t k = 0; k < K; ++k) {
    const int8_t* w = panel + k * PANEL + c0;
    V wv[SUB_VECTORS];
    for (int v = 0; v < SUB_VECTORS; ++v) wv[v] = vload_i8(w + v * VL);
    for (int m = 0; m < MB; ++m) {
      V xb = vset1(x_value(x, m * ldx + k));
      for (int v = 0; v < SUB_VECTORS; ++v) acc[m][v] = vfma(xb, wv[v], acc[m][v]);
    }
  }
}

// bf16 weights, bf16 inputs: one pair (k even, k odd) per step, as a bf16 dot instruction or two float FMAs.
template <int MB>
inline void tile_bf16(const uint16_t* x, int64_t ldx, const uint16_t* panel, int64_t K, int c0,
                      V acc[MB][SUB_VECTORS]) {
  const int64_t pairs = (K + 1) / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    const uint16_t* w = panel + (p * PANEL + c0) * 2;
    for (int m = 0; m < MB; ++m) {
      const uint16_t* xr = x + m * ldx + 2 * p;
      uint16_t second = (2 * p + 1 < K) ? xr[1] : 0;
#if DPBF16
      uint32_t pair = uint32_t(xr[0]) | (uint32_t(second) << 16);
      for (int v = 0; v < SUB_VECTORS; ++v) acc[m][v] = vdpbf16(acc[m][v], pair, w + 2 * v * VL);
#else
      V x0 = vset1(bf16_to_float(xr[0])), x1 = vset1(bf16_to_float(second));
      for (int v = 0; v < SUB_VECTORS; ++v) {
        V w0, w1;
        vload_bf16_pairs(w + 2 * v * VL, &w0, &w1);
        acc[m][v] = vfma(x1, w1, vfma(x0, w0, acc[m][v]));
      }
#endif
    }
  }
}

template <typename OT>
inline void store_row(OT* out, const V acc[SUB_VECTORS], int64_t column, int64_t N, const float* scale,
                      const float* bias) {
  for (int v = 0; v < SUB_VECTORS; ++v) {
    int64_t c = column + v * VL;
    if (c >= N) return;
    int valid = int(std::min<int64_t>(VL, N - c));
    V value = acc[v];
    if (scale) value = vmul(value, vload_partial(scale + c, valid));
    if (bias) value = vadd(value, vload_partial(bias + c, valid));
    vstore_out(out + c, value, valid);
  }
}

template <int MB, typename XT, typename WT, typename OT>
inline void tile(const XT* x, int64_t K, const WT* panel, int c0, OT* out, int64_t column, int64_t N,
                 const float* scale, const float* bias) {
  V acc[MB][SUB_VECTORS];
  for (int m = 0; m < MB; ++m)
    for (int v = 0; v < SUB_VECTORS; ++v) acc[m][v] = vzero();
  if constexpr (std::is_same_v<WT, float>) tile_f32<MB>(x, K, panel, K, c0, acc);
  else if constexpr (std::is_same_v<WT, int8_t>) tile_i8<MB>(x, K, panel, K, c0, acc);
  else tile_bf16<MB>(x, K, panel, K, c0, acc);
  for (int m = 0; m < MB; ++m) store_row(out + m * N, acc[m], column, N, scale, bias);
}

// y (M, N) = x (M, K) . W^T (+ per-column scale, + bias), W packed in panels of 64 columns.
template <typename XT, typename WT, typename OT>
void linear_kernel(const XT* x, int64_t M, int64_t K, const WT* packed, int64_t N, const float* scale,
                   const float* bias, OT* out) {
  const int64_t panels = (N + PANEL - 1) / PANEL;
  const int64_t panel_size = std::is_same_v<WT, uint16_t> ? ((K + 1) / 2) * PANEL * 2 : K * PANEL;
  const int64_t subs = PANEL_VECTORS / SUB_VECTORS;
  const int64_t tasks = panels * subs;
#pragma omp parallel for schedule(static) if (tasks > 1)
  for (int64_t task = 0; task < tasks; ++task) {
    {  // contiguous halves per thread: each streams its weights in order
      const int64_t p = task / subs;
      const int c0 = int(task % subs) * SUB_VECTORS * VL;
      const WT* panel = packed + p * panel_size;
      const int64_t column = p * PANEL + c0;
      for (int64_t m = 0; m < M;) {
        const int64_t rows = std::min<int64_t>(ROW_TILE, M - m);
        auto run = [&](auto tile_rows) {
          tile<decltype(tile_rows)::value>(x + m * K, K, panel, c0, out + m * N, column, N, scale, bias);
        };
        switch (rows) {
          case 1: run(std::integral_constant<int, 1>()); break;
          case 2: run(std::integral_constant<int, 2>()); break;
          case 3: run(std::integral_constant<int, 3>()); break;
          case 4: run(std::integral_constant<int, 4>()); break;
          case 5: run(std::integral_constant<int, ROW_TILE >= 5 ? 5 : 1>()); break;
          default: run(std::integral_constant<int, ROW_TILE >= 6 ? 6 : 1>()); break;
        }
        m += rows;
      }
    }
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
template <typename T>
void attend_row(const T* q, const T* keys, const T* values, int64_t key_stride, int64_t value_stride,
                const float* mask_row,
                int64_t length, int64_t D, float scaling, std::vector<int64_t>& visible,
                std::vector<float>& scores, T* out) {
  visible.clear();
  for (int64_t j = 0; j < length; j += VL) {
    const int valid = int(std::min<int64_t>(VL, length - j));
    uint32_t bits = vvisible_bits(vload_partial(mask_row + j, valid)) & uint32_t((uint64_t(1) << valid) - 1);
    for (; bits; bits &= bits - 1) visible.push_back(j + __builtin_ctz(bits));
  }
  const int64_t n = int64_t(visible.size());
  scores.resize(n + VL);
  const int64_t chunks = (D + VL - 1) / VL;
  V query[128 / VL];
  for (int64_t c = 0; c < chunks; ++c) query[c] = load_row(q, c * VL, int(std::min<int64_t>(VL, D - c * VL)));
  // Four keys at a time (independent chains the core overlaps); each key's dot is the same sequence either way.
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const T* k0 = keys + visible[i] * key_stride;
    const T* k1 = keys + visible[i + 1] * key_stride;
    const T* k2 = keys + visible[i + 2] * key_stride;
    const T* k3 = keys + visible[i + 3] * key_stride;
    V a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
    for (int64_t c = 0; c < chunks; ++c) {
      const int valid = int(std::min<int64_t>(VL, D - c * VL));
      a0 = vfma(query[c], load_row(k0, c * VL, valid), a0);
      a1 = vfma(query[c], load_row(k1, c * VL, valid), a1);
      a2 = vfma(query[c], load_row(k2, c * VL, valid), a2);
      a3 = vfma(query[c], load_row(k3, c * VL, valid), a3);
    }
    scores[i] = vreduce_add(a0) * scaling + mask_row[visible[i]];
    scores[i + 1] = vreduce_add(a1) * scaling + mask_row[visible[i + 1]];
    scores[i + 2] = vreduce_add(a2) * scaling + mask_row[visible[i + 2]];
    scores[i + 3] = vreduce_add(a3) * scaling + mask_row[visible[i + 3]];
  }
  for (; i < n; ++i) {
    const T* key = keys + visible[i] * key_stride;
    V a0 = vzero();
    for (int64_t c = 0; c < chunks; ++c)
      a0 = vfma(query[c], load_row(key, c * VL, int(std::min<int64_t>(VL, D - c * VL))), a0);
    scores[i] = vreduce_add(a0) * scaling + mask_row[visible[i]];
  }
  float maximum = -INFINITY;
  for (int64_t j = 0; j < n; ++j) maximum = std::max(maximum, scores[j]);
  V total = vzero();
  for (int64_t i = 0; i < n; i += VL) {
    int valid = int(std::min<int64_t>(VL, n - i));
    V e = vexp(vadd(vload_partial(scores.data() + i, valid), vset1(-maximum)));
    e = vmask_tail(e, valid);
    vstore(scores.data() + i, e);
    total = vadd(total, e);
  }
  const float inverse = n ? 1.0f / vreduce_add(total) : 0.0f;
  V acc[128 / VL];  // head_dim <= 128
  for (int64_t c = 0; c < chunks; ++c) acc[c] = vzero();
  for (int64_t i = 0; i < n; ++i) {
    const T* value = values + visible[i] * value_stride;
    V p = vset1(scores[i]);
    for (int64_t c = 0; c < chunks; ++c) {
      int valid = int(std::min<int64_t>(VL, D - c * VL));
      acc[c] = vfma(p, load_row(value, c * VL, valid), acc[c]);
    }
  }
  for (int64_t c = 0; c < chunks; ++c) {
    int valid = int(std::min<int64_t>(VL, D - c * VL));
    vstore_out(out + c * VL, vmul(acc[c], vset1(inverse)), valid);
  }
}

// q (B, Hq, W, D), keys/values (B, Hkv, C, D) (last axis contiguous), mask (B or 1, 1, W, >= C) float32;
// out (B, W, Hq, D) contiguous.
template <typename T>
void attention_kernel(const T* q, const int64_t* q_strides, const T* k, const T* v, const int64_t* kv_strides,
                      const float* mask, const int64_t* mask_strides, int64_t B, int64_t Hq, int64_t Hkv, int64_t W,
                      int64_t C, int64_t D, float scaling, T* out) {
  const int64_t groups = Hq / Hkv;
  const int64_t tasks = B * Hq * W;
#pragma omp parallel if (tasks > 1)
  {
    std::vector<int64_t> visible;
    std::vector<float> scores;
    visible.reserve(C);
    scores.reserve(C + VL);
#pragma omp for schedule(static)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t b = task / (Hq * W), h = (task / W) % Hq, row = task % W;
      const int64_t g = h / groups;
      const T* qr = q + b * q_strides[0] + h * q_strides[1] + row * q_strides[2];
      const T* keys = k + b * kv_strides[0] + g * kv_strides[1];
      const T* values = v + b * kv_strides[4] + g * kv_strides[5];
      const float* mask_row = mask + b * mask_strides[0] + row * mask_strides[2];
      T* o = out + ((b * W + row) * Hq + h) * D;
      attend_row(qr, keys, values, kv_strides[2], kv_strides[6], mask_row, C, D, scaling, visible, scores, o);
    }
  }
}
