// A decode step's whole layer stack in one call: every decoder layer of a Llama-family
// model whose products run on quantized blocks, for up to 16 decode rows.
//
// Why: at one to a few rows a layer is ten small operations (two RMSNorms, four products,
// rotary, the cache write, attention, SwiGLU, two residual adds). Driven from Python each
// is a module call, a ctypes call and a fresh tensor: about 5 ms of a ~9.5 ms step for
// SmolLM2's 30 layers, while the products themselves stream the weights in ~2.5 ms. Here
// the layer loop runs in C++ and calls the very kernels the modules call.
//
// Exactness: each operation is the same kernel, with the same inputs, in the same order
// as the module path (engine_ext/model/llama.py); the residual and bias adds are single
// fp32 sums, as torch's. So a step's hidden states are bitwise the module path's.
#include <cstdint>
#include <vector>

extern "C" {
void kq_q4_linear(const float* x, int64_t rows, int64_t K, const uint8_t* q, const float* d, const float* m,
                  int64_t N, float* y, int threads);
void kq_q8_linear(const float* x, int64_t rows, int64_t K, const int8_t* q, const float* d, int64_t N, float* y,
                  int threads);
int kq_decode_attention(const float* q, const float* k, const float* v, const int64_t* slots,
                        const int64_t* lengths, float* out, int64_t B, int64_t H, int64_t KVH, int64_t D,
                        int64_t Lmax, float scale, int threads);
void kq_rms_norm(const float* x, const float* w, float* out, int64_t rows, int64_t dim, float eps, int threads);
void kq_rotary(const float* x, int64_t x_stride, const float* cos, const float* sin, int64_t cs_stride,
               float* out, int64_t rows, int64_t heads, int64_t D, int64_t rd, int threads);
void kq_swiglu(const float* gate_up, float* out, int64_t rows, int64_t I, int threads);

// One quantized product y = x @ W^T (+ bias): W (N, K) as Q4_1 (format 0: q, d, m) or
// Q8_0 (format 1: q, d), the layouts of quant_linear.cpp. bias may be null.
struct KqLinear {
  int64_t format;
  const void* q;
  const float* d;
  const float* m;
  const float* bias;
  int64_t N, K;
};

// One decoder layer: its two norms' weights, its four products, its cache (slots, KVH, D).
struct KqLayer {
  const float* input_norm;
  const float* post_norm;
  KqLinear qkv, o, gate_up, down;
  float* k_cache;
  float* v_cache;
};

struct KqModel {
  int64_t num_layers, hidden, heads, kv_heads, head_dim, rotary_dim, intermediate;
  float eps, scale;
  const KqLayer* layers;
  const float* final_norm;
};
}  // extern "C"

namespace {

void linear(const KqLinear& w, const float* x, int64_t rows, float* y, int threads) {
  if (w.format == 0)
    kq_q4_linear(x, rows, w.K, static_cast<const uint8_t*>(w.q), w.d, w.m, w.N, y, threads);
  else
    kq_q8_linear(x, rows, w.K, static_cast<const int8_t*>(w.q), w.d, w.N, y, threads);
  if (w.bias != nullptr)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t n = 0; n < w.N; ++n) y[r * w.N + n] = y[r * w.N + n] + w.bias[n];
}

void add(float* x, const float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = x[i] + y[i];
}

}  // namespace

extern "C" {

// x (B, hidden): the rows' embeddings in, their final (normed) hidden states out. cos, sin
// (B, rotary_dim); slot_mapping (B,): where each row's K/V go; slots (B, Lmax) and lengths
// (B,): each row's keys, its own last (decode_attention.cpp); each cache holds num_slots.
// Returns 1; -1, touching nothing, where a slot or a length is out of range (a cache
// written out of bounds would corrupt another sequence's keys); 0 where attention
// declines the shapes (the caller checks them first; x is then partly computed).
int kq_decode_forward(const KqModel* model, float* x, int64_t B, const float* cos, const float* sin,
                      const int64_t* slot_mapping, const int64_t* slots, const int64_t* lengths, int64_t Lmax,
                      int64_t num_slots, int threads) {
  for (int64_t b = 0; b < B; ++b) {
    if (slot_mapping[b] < 0 || slot_mapping[b] >= num_slots || lengths[b] < 1 || lengths[b] > Lmax) return -1;
    for (int64_t l = 0; l < lengths[b]; ++l)
      if (slots[b * Lmax + l] < 0 || slots[b * Lmax + l] >= num_slots) return -1;
  }
  const int64_t hidden = model->hidden, H = model->heads, KVH = model->kv_heads, D = model->head_dim;
  const int64_t q_size = H * D, kv_size = KVH * D, qkv_size = q_size + 2 * kv_size;
  std::vector<float> h(B * hidden), qkv(B * qkv_size), qk(B * (q_size + kv_size)), q(B * q_size),
      attn(B * q_size), o(B * hidden), gate_up(B * 2 * model->intermediate), act(B * model->intermediate);
  for (int64_t l = 0; l < model->num_layers; ++l) {
    const KqLayer& layer = model->layers[l];
    kq_rms_norm(x, layer.input_norm, h.data(), B, hidden, model->eps, threads);
    linear(layer.qkv, h.data(), B, qkv.data(), threads);  // (B, q | k | v)
    // q and k heads rotate together, as in the module: (B, H + KVH, D)
    kq_rotary(qkv.data(), qkv_size, cos, sin, model->rotary_dim, qk.data(), B, H + KVH, D, model->rotary_dim,
              threads);
    for (int64_t b = 0; b < B; ++b) {
      const float* k_row = qk.data() + b * (q_size + kv_size) + q_size;
      const float* v_row = qkv.data() + b * qkv_size + q_size + kv_size;
      float* k_dst = layer.k_cache + slot_mapping[b] * kv_size;
      float* v_dst = layer.v_cache + slot_mapping[b] * kv_size;
      for (int64_t i = 0; i < kv_size; ++i) k_dst[i] = k_row[i];
      for (int64_t i = 0; i < kv_size; ++i) v_dst[i] = v_row[i];
      for (int64_t i = 0; i < q_size; ++i) q[b * q_size + i] = qk[b * (q_size + kv_size) + i];
    }
    if (!kq_decode_attention(q.data(), layer.k_cache, layer.v_cache, slots, lengths, attn.data(), B, H, KVH, D,
                             Lmax, model->scale, threads))
      return 0;
    linear(layer.o, attn.data(), B, o.data(), threads);
    add(x, o.data(), B * hidden);
    kq_rms_norm(x, layer.post_norm, h.data(), B, hidden, model->eps, threads);
    linear(layer.gate_up, h.data(), B, gate_up.data(), threads);
    kq_swiglu(gate_up.data(), act.data(), B, model->intermediate, threads);
    linear(layer.down, act.data(), B, o.data(), threads);
    add(x, o.data(), B * hidden);
  }
  kq_rms_norm(x, model->final_norm, h.data(), B, hidden, model->eps, threads);
  for (int64_t i = 0; i < B * hidden; ++i) x[i] = h[i];
  return 1;
}

}  // extern "C"
