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
struct AttentionScratch {
  std::vector<uint64_t> who;     // per key: the rows of the block that see it
  std::vector<float> scores;     // per (row, head): scores, then probabilities, of its visible keys in cache order
  std::vector<int64_t> count;    // per row: its visible keys
  std::vector<int64_t> cursor;   // per row: the next visible key
  std::vector<float> query, sum; // per (row, head, chunk): VL floats each (a vector of __m512 would lose alignment)
};

// A block of rows (<= 64) and `heads` query heads sharing one kv head: every key and value vector is loaded once
// for all the (row, head) pairs that see it. Each pair still reduces over its own visible keys in cache order, one
// score and one accumulation at a time, with the same instructions as any other block: the result of a row is
// what that row computes alone, wherever its visible keys lie.
template <typename T>
void attend_block(const T* const* q_rows, int64_t q_head_stride, const T* keys, const T* values, int64_t key_stride,
                  int64_t value_stride, const float* const* mask_rows, int rows, int heads, int64_t length, int64_t D,
                  float scaling, AttentionScratch& s, T* const* out_rows) {
  const int64_t chunks = (D + VL - 1) / VL;
  auto valid_of = [&](int64_t c) { return int(std::min<int64_t>(VL, D - c * VL)); };
  s.who.assign(length, 0);
  s.count.assign(rows, 0);
  for (int r = 0; r < rows; ++r)
    for (int64_t j = 0; j < length; j += VL) {
      const int valid = int(std::min<int64_t>(VL, length - j));
      uint32_t bits = vvisible_bits(vload_partial(mask_rows[r] + j, valid)) & uint32_t((uint64_t(1) << valid) - 1);
      s.count[r] += __builtin_popcount(bits);
      for (; bits; bits &= bits - 1) s.who[j + __builtin_ctz(bits)] |= uint64_t(1) << r;
    }
  const int pairs = rows * heads;
  s.query.resize(size_t(pairs) * chunks * VL);
  s.sum.assign(size_t(pairs) * chunks * VL, 0.0f);
  s.scores.resize(size_t(pairs) * (length + VL));
  for (int r = 0; r < rows; ++r)
    for (int h = 0; h < heads; ++h)
      for (int64_t c = 0; c < chunks; ++c)
        vstore(s.query.data() + ((r * heads + h) * chunks + c) * VL,
               load_row(q_rows[r] + h * q_head_stride, c * VL, valid_of(c)));
  auto scores_of = [&](int pair) { return s.scores.data() + size_t(pair) * (length + VL); };
  V loaded[128 / VL];
  s.cursor.assign(rows, 0);
  for (int64_t j = 0; j < length; ++j) {
    uint64_t seen = s.who[j];
    if (!seen) continue;
    const T* key = keys + j * key_stride;
    for (int64_t c = 0; c < chunks; ++c) loaded[c] = load_row(key, c * VL, valid_of(c));
    for (; seen; seen &= seen - 1) {
      const int r = __builtin_ctzll(seen);
      for (int h = 0; h < heads; ++h) {
        const float* query = s.query.data() + (r * heads + h) * chunks * VL;
        V acc = vzero();
        for (int64_t c = 0; c < chunks; ++c) acc = vfma(vload(query + c * VL), loaded[c], acc);
        scores_of(r * heads + h)[s.cursor[r]] = vreduce_add(acc) * scaling + mask_rows[r][j];
      }
      ++s.cursor[r];
    }
  }
  std::vector<float> inverse(pairs);
  for (int pair = 0; pair < pairs; ++pair) {
    const int64_t n = s.count[pair / heads];
    float* sc = scores_of(pair);
    float maximum = -INFINITY;
    for (int64_t i = 0; i < n; ++i) maximum = std::max(maximum, sc[i]);
    V total = vzero();
    for (int64_t i = 0; i < n; i += VL) {
      const int valid = int(std::min<int64_t>(VL, n - i));
      V e = vmask_tail(vexp(vadd(vload_partial(sc + i, valid), vset1(-maximum))), valid);
      vstore(sc + i, e);
      total = vadd(total, e);
    }
    inverse[pair] = n ? 1.0f / vreduce_add(total) : 0.0f;
  }
  s.cursor.assign(rows, 0);
  for (int64_t j = 0; j < length; ++j) {
    uint64_t seen = s.who[j];
    if (!seen) continue;
    const T* value = values + j * value_stride;
    for (int64_t c = 0; c < chunks; ++c) loaded[c] = load_row(value, c * VL, valid_of(c));
    for (; seen; seen &= seen - 1) {
      const int r = __builtin_ctzll(seen);
      for (int h = 0; h < heads; ++h) {
        V p = vset1(scores_of(r * heads + h)[s.cursor[r]]);
        float* sum = s.sum.data() + (r * heads + h) * chunks * VL;
        for (int64_t c = 0; c < chunks; ++c) vstore(sum + c * VL, vfma(p, loaded[c], vload(sum + c * VL)));
      }
      ++s.cursor[r];
    }
  }
  for (int r = 0; r < rows; ++r)
    for (int h = 0; h < heads; ++h)
      for (int64_t c = 0; c < chunks; ++c)
        vstore_out(out_rows[r] + h * D + c * VL,
                   vmul(vload(s.sum.data() + ((r * heads + h) * chunks + c) * VL), vset1(inverse[r * heads + h])),
                   valid_of(c));
}

// q (B, Hq, W, D), keys/values (B, Hkv, C, D) (last axis contiguous), mask (B or 1, 1, W, >= C) float32;
// out (B, W, Hq, D) contiguous. Tasks: (batch, kv head, row block, head block), enough of them for every thread.
template <typename T>
void attention_kernel(const T* q, const int64_t* q_strides, const T* k, const T* v, const int64_t* kv_strides,
                      const float* mask, const int64_t* mask_strides, int64_t B, int64_t Hq, int64_t Hkv, int64_t W,
                      int64_t C, int64_t D, float scaling, T* out) {
  const int64_t groups = Hq / Hkv, threads = omp_get_max_threads();
  int64_t row_blocks = std::max<int64_t>((W + 63) / 64, std::min<int64_t>(W, (2 * threads + B * Hkv - 1) / (B * Hkv)));
  const int64_t head_blocks = B * Hkv * row_blocks >= 2 * threads ? 1 : groups;
  const int64_t rows_per_block = (W + row_blocks - 1) / row_blocks;
  row_blocks = (W + rows_per_block - 1) / rows_per_block;
  const int64_t heads_per_block = groups / head_blocks;
  const int64_t tasks = B * Hkv * row_blocks * head_blocks;
#pragma omp parallel if (tasks > 1)
  {
    AttentionScratch scratch;
    std::vector<const T*> q_rows(rows_per_block);
    std::vector<const float*> mask_rows(rows_per_block);
    std::vector<T*> out_rows(rows_per_block);
#pragma omp for schedule(static)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t hb = task % head_blocks, rb = (task / head_blocks) % row_blocks;
      const int64_t g = (task / (head_blocks * row_blocks)) % Hkv, b = task / (head_blocks * row_blocks * Hkv);
      const int64_t first_row = rb * rows_per_block, rows = std::min(rows_per_block, W - first_row);
      const int64_t first_head = g * groups + hb * heads_per_block;
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t row = first_row + r;
        q_rows[r] = q + b * q_strides[0] + first_head * q_strides[1] + row * q_strides[2];
        mask_rows[r] = mask + b * mask_strides[0] + row * mask_strides[2];
        out_rows[r] = out + ((b * W + row) * Hq + first_head) * D;
      }
      attend_block(q_rows.data(), q_strides[1], k + b * kv_strides[0] + g * kv_strides[1],
                   v + b * kv_strides[4] + g * kv_strides[5], kv_strides[2], kv_strides[6], mask_rows.data(),
                   int(rows), int(heads_per_block), C, D, scaling, scratch, out_rows.data());
    }
  }
}
