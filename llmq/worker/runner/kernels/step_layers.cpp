// Every decoder layer of a step in one call.
//
// The ~25 Python-level torch calls (views, KV writes, adds) each layer makes were a large part
// of a lone stream's step outside the projections (docs/performance.md). Here the layer loop
// runs in C++: the same projections (llmq's panels, oneDNN's packed matmul, or at::linear), the
// same small-step ops, the decodes' attention kernel, the prompts' SDPA, the KV written by plain
// copies, so its output is bit-equal to the Python loop's with those ops. The families' layers
// differ only in what a layer holds: q/k norms per head (Qwen 3, Gemma 3), norms after the
// attention and after the MLP (Gemma), a GELU-tanh MLP (Gemma), a second rotary base (Gemma 3's
// sliding layers). LoRA adapters add their deltas to the projections of their rows through
// lora_deltas, as the Python loop does.

#include <ATen/core/Tensor.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <torch/library.h>

#include <cstring>
#include <optional>
#include <vector>

#include "ops.h"

namespace {

// A layer's tensors, in decoder_cpp_step.layer_tensors' order; an empty tensor: none.
enum LayerTensor : int64_t {
  kInputNorm,
  kAttnOutNorm,  // Gemma: the attention's output normed before the residual add
  kMlpInNorm,
  kMlpOutNorm,  // Gemma: the MLP's output normed before the residual add
  kQNorm,       // Qwen 3, Gemma 3: each query head normed, then each key head
  kKNorm,
  kQkv,
  kO,
  kGateUp,
  kDown,
  kQkvBias,
  kOBias,
  kGateUpBias,
  kDownBias,
  kQkvScale,  // a quantized projection's scales (int8: [N]; int4: [K / group, N, 2]); else none
  kOScale,
  kGateUpScale,
  kDownScale,
  kTensorsPerLayer,
};

// decoder_layers.ACTIVATION_CODES: the MLP's activation of gate, times up.
enum Activation : int64_t { kSilu = 0, kGeluTanh = 1 };

bool given(const at::Tensor& t) { return t.defined() && t.numel(); }

// act(gate) * up over [rows, 2 * width], as the Python loop computes it.
at::Tensor activate(const at::Tensor& gate_up, int64_t activation) {
  if (activation == kSilu) return llmq::silu_mul(gate_up);
  const int64_t width = gate_up.size(1) / 2;
  return at::mul(at::gelu(gate_up.narrow(1, 0, width), "tanh"), gate_up.narrow(1, width, width));
}

// x normed with `weight` where the layer has one; x itself where not.
at::Tensor norm_if(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return given(weight) ? llmq::rms_norm(x, weight, eps) : x;
}

// Keys [T, Hkv, D] and values into their slots of one layer of the pool [2 * Hkv, slots, D].
void write_kv(const at::Tensor& keys, const at::Tensor& values, at::Tensor& layer_kv,
              const int64_t* slots, int64_t kv_heads) {
  const int64_t tokens = keys.size(0), dim = keys.size(2), width = dim * keys.element_size();
  auto* pool = static_cast<char*>(layer_kv.data_ptr());
  const int64_t slot_bytes = width, head_bytes = layer_kv.size(1) * width;
  const auto* k = static_cast<const char*>(keys.const_data_ptr());
  const auto* v = static_cast<const char*>(values.const_data_ptr());
  const int64_t k_row = keys.stride(0) * keys.element_size(),
                k_head = keys.stride(1) * keys.element_size();
  const int64_t v_row = values.stride(0) * values.element_size(),
                v_head = values.stride(1) * values.element_size();
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t h = 0; h < kv_heads; ++h) {
      std::memcpy(pool + h * head_bytes + slots[t] * slot_bytes, k + t * k_row + h * k_head, width);
      std::memcpy(pool + (kv_heads + h) * head_bytes + slots[t] * slot_bytes,
                  v + t * v_row + h * v_head, width);
    }
  }
}

// A step's prompt chunks, as attention.PrefillChunk holds them: rows [start, start + len) of
// the step; then, per KV group and prompt (a group's after the previous group's), the tokens in
// the group's cache after it, the blocks covering them, and the mask (none: a fresh prompt,
// causal over its own keys; a window's where the group's layers ask one).
struct Prompts {
  at::IntArrayRef starts, lens, contexts;
  at::TensorList blocks;
  const c10::List<std::optional<at::Tensor>>& masks;
};

// One KV group's part of the step (attention.StepMetadata; a model with sliding windows has a
// group per window, group_steps.py): the cache slot of each token, the decodes' block tables
// and context lengths as paged_decode_attention takes them, the window its layers ask (0: none),
// and where its prompts' entries start in Prompts.
struct KVGroup {
  const int64_t* slots;
  at::Tensor block_tables, context_lens;
  int64_t window;
  size_t first_prompt;
};

// SDPA for each prompt chunk, as attention.paged_attention runs it: over the chunk's own keys
// and values, or over its context gathered from the pool by whole blocks.
void attend_prompts(at::Tensor& attn, const at::Tensor& qk, const at::Tensor& qkv,
                    const at::Tensor& layer_kv, const Prompts& p, size_t first, int64_t heads,
                    int64_t kv_heads, int64_t bs, double scale) {
  const int64_t dim = layer_kv.size(2), pool_blocks = layer_kv.size(1) / bs;
  for (size_t i = 0; i < p.starts.size(); ++i) {
    const int64_t s = p.starts[i], n = p.lens[i];
    const at::Tensor q = qk.narrow(0, s, n).narrow(1, 0, heads).transpose(0, 1).unsqueeze(0);
    const std::optional<at::Tensor> mask = p.masks.get(first + i);
    at::Tensor k, v;
    if (!mask.has_value()) {
      k = qk.narrow(0, s, n).narrow(1, heads, kv_heads).transpose(0, 1).unsqueeze(0);
      v = qkv.narrow(0, s, n).narrow(1, heads + kv_heads, kv_heads).transpose(0, 1).unsqueeze(0);
    } else {
      const at::Tensor context = layer_kv.view({2 * kv_heads, pool_blocks, bs, dim})
                                     .index_select(1, p.blocks[first + i])
                                     .view({2 * kv_heads, -1, dim})
                                     .narrow(1, 0, p.contexts[first + i]);
      k = context.narrow(0, 0, kv_heads).unsqueeze(0);
      v = context.narrow(0, kv_heads, kv_heads).unsqueeze(0);
    }
    const at::Tensor out =
        at::scaled_dot_product_attention(q, k, v, mask, 0.0, !mask.has_value(), scale, true);
    attn.narrow(0, s, n).copy_(out[0].transpose(0, 1));
  }
}

// A layer's attention: its keys and values written to its group's slots, the decodes through
// the kernel, the prompts through SDPA, into attn [T, heads, D].
void attend_layer(at::Tensor& attn, const at::Tensor& qk, const at::Tensor& qkv,
                  at::Tensor layer_kv, const KVGroup& group, const Prompts& prompts,
                  int64_t num_decodes, int64_t heads, int64_t kv_heads, int64_t bs, double scale) {
  write_kv(qk.narrow(1, heads, kv_heads), qkv.narrow(1, heads + kv_heads, kv_heads), layer_kv,
           group.slots, kv_heads);
  if (num_decodes > 0) {
    at::Tensor decoded = attn.narrow(0, 0, num_decodes);
    llmq::paged_decode_attention(decoded, qk.narrow(0, 0, num_decodes).narrow(1, 0, heads),
                                 layer_kv, group.block_tables, group.context_lens, bs, scale,
                                 group.window);
  }
  attend_prompts(attn, qk, qkv, layer_kv, prompts, group.first_prompt, heads, kv_heads, bs, scale);
}

// Each layer's pool [2 * kv_heads, slots, head_dim], alike, in the model's dtype.
void check_pools(at::TensorList kv, int64_t layers, int64_t kv_heads, at::ScalarType dtype) {
  TORCH_CHECK(static_cast<int64_t>(kv.size()) == layers, "step_layers: a KV pool a layer");
  for (const at::Tensor& layer_kv : kv) {
    TORCH_CHECK(layer_kv.dim() == 3 && layer_kv.size(0) == 2 * kv_heads &&
                    layer_kv.size(1) == kv[0].size(1) && layer_kv.size(2) == kv[0].size(2) &&
                    layer_kv.is_contiguous(),
                "step_layers: a layer's pool [2 * kv_heads, slots, head_dim]");
    TORCH_CHECK(layer_kv.scalar_type() == dtype,
                "step_layers: a pool in the model's dtype (not an 8-bit one)");
  }
}

// The step's KV groups, their lists checked against the pool and the step's tokens.
std::vector<KVGroup> kv_groups(at::TensorList slots, at::TensorList block_tables,
                               at::TensorList context_lens, at::IntArrayRef windows,
                               const Prompts& prompts, int64_t pool_slots, int64_t tokens) {
  const size_t count = slots.size(), num_prompts = prompts.starts.size();
  TORCH_CHECK(count >= 1 && block_tables.size() == count && context_lens.size() == count &&
                  windows.size() == count,
              "step_layers: slots, block tables, context lengths and a window a KV group");
  TORCH_CHECK(prompts.lens.size() == num_prompts &&
                  prompts.contexts.size() == count * num_prompts &&
                  prompts.blocks.size() == count * num_prompts &&
                  prompts.masks.size() == count * num_prompts,
              "step_layers: a start and length a prompt chunk; a context, block list and mask "
              "a KV group and prompt chunk");
  std::vector<KVGroup> groups;
  for (size_t g = 0; g < count; ++g) {
    const at::Tensor& s = slots[g];
    TORCH_CHECK(s.scalar_type() == at::kLong && s.is_contiguous() && s.numel() == tokens,
                "step_layers: one int64 slot a token");
    const int64_t* slot = s.const_data_ptr<int64_t>();
    for (int64_t t = 0; t < tokens; ++t)
      TORCH_CHECK(slot[t] >= 0 && slot[t] < pool_slots, "step_layers: slot out of the pool");
    groups.push_back({slot, block_tables[g], context_lens[g], windows[g], g * num_prompts});
  }
  return groups;
}

// A step's LoRA adapters, as lora_slots.StepAdapters passes them: per projection (qkv, o,
// gate_up, down) the slots' A [layers, slots, parts * room, in] and B transposed
// [layers, slots, room, out] (empty: no loaded adapter targets it), and lora_deltas' scales,
// rows, groups and ranks.
struct Adapters {
  at::TensorList weights;
  at::Tensor scales, rows;
  at::IntArrayRef groups, ranks;
};

// y (x projected by the base) with each adapter's delta added to its rows; `columns`: the
// projection's parts' first columns, then its width.
at::Tensor add_deltas(const Adapters& lora, const at::Tensor& x, at::Tensor y, int64_t layer,
                      int64_t projection, at::IntArrayRef columns) {
  if (lora.groups.empty() || !given(lora.weights[2 * projection])) return y;
  llmq::lora_deltas(y, x, lora.weights[2 * projection][layer],
                    lora.weights[2 * projection + 1][layer], columns, lora.scales, lora.rows,
                    lora.groups, lora.ranks);
  return y;
}

// What every layer of the step shares: its weights' layout and activation, the projections'
// widths and their parts' columns (for the LoRA deltas), the heads, the attention's scale and
// the norms' epsilon.
struct LayerShape {
  int64_t layout, activation;
  at::IntArrayRef out_features;
  std::vector<int64_t> columns[4];  // qkv: q, k, v; o; gate_up: gate, up; down
  int64_t heads, kv_heads, dim, block_size, num_decodes;
  double scale, eps;
};

// Projection p (0: qkv, 1: o, 2: gate_up, 3: down) of layer l's weights w, on x, with the
// adapters' deltas.
at::Tensor project_layer(const at::Tensor& x, const at::Tensor* w, int64_t l, int p,
                         const LayerShape& s, const Adapters& lora) {
  const int64_t weight = kQkv + p;
  const at::Tensor y =
      llmq::project(x, w[weight], w[kQkvBias + p], w[kQkvScale + p], s.layout, s.out_features[p]);
  return add_deltas(lora, x, y, l, p, s.columns[p]);
}

// Layer l on hidden states h: the attention over its KV group's cache, then the MLP.
at::Tensor run_layer(at::Tensor h, const at::Tensor* w, int64_t l, const at::Tensor& cos,
                     const at::Tensor& sin, at::Tensor layer_kv, const KVGroup& group,
                     const Prompts& prompts, at::Tensor& attn, const LayerShape& s,
                     const Adapters& lora) {
  const int64_t tokens = h.size(0), heads = s.heads, kv_heads = s.kv_heads;
  at::Tensor x = llmq::rms_norm(h, w[kInputNorm], s.eps);
  const at::Tensor qkv =
      project_layer(x, w, l, 0, s, lora).view({tokens, heads + 2 * kv_heads, s.dim});
  at::Tensor qk =
      given(w[kQNorm]) ? llmq::qk_norm(qkv, w[kQNorm], w[kKNorm], heads, kv_heads, s.eps) : qkv;
  qk = llmq::rotary(qk, cos, sin, heads + kv_heads);
  attend_layer(attn, qk, qkv, layer_kv, group, prompts, s.num_decodes, heads, kv_heads,
               s.block_size, s.scale);
  const at::Tensor o = project_layer(attn.view({tokens, heads * s.dim}), w, l, 1, s, lora);
  h = at::add(h, norm_if(o, w[kAttnOutNorm], s.eps));
  x = llmq::rms_norm(h, w[kMlpInNorm], s.eps);
  const at::Tensor act = activate(project_layer(x, w, l, 2, s, lora), s.activation);
  const at::Tensor down = project_layer(act, w, l, 3, s, lora);
  return at::add(h, norm_if(down, w[kMlpOutNorm], s.eps));
}

}  // namespace

namespace llmq {

// h [T, hidden] (the tokens' embeddings: decodes first, then prompt chunks); cos and sin: per
// rotary base [T, 1, D], layer_rotary[l] the one layer l uses; weights: kTensorsPerLayer per
// layer; kv: each layer's pool [2 * Hkv, slots, D]; per KV group (one but for a model with
// sliding windows) as KVGroup holds it, its slots [T] int64, its decodes' block tables and
// context lengths, its window; layer_group[l]: layer l's group; the prompt chunks as Prompts
// holds them. Returns the last layer's hidden states.
at::Tensor step_layers(
    const at::Tensor& h_in, at::TensorList cos, at::TensorList sin, at::IntArrayRef layer_rotary,
    at::TensorList weights, int64_t layout, int64_t activation, at::IntArrayRef out_features,
    at::TensorList kv, at::TensorList slots, int64_t num_decodes, at::TensorList block_tables,
    at::TensorList context_lens, at::IntArrayRef windows, at::IntArrayRef layer_group,
    at::IntArrayRef prompt_starts, at::IntArrayRef prompt_lens, at::IntArrayRef prompt_contexts,
    at::TensorList prompt_blocks, const c10::List<std::optional<at::Tensor>>& prompt_masks,
    int64_t block_size, int64_t heads, int64_t kv_heads, double scale, double eps,
    at::TensorList lora_weights, const at::Tensor& lora_scales, const at::Tensor& lora_rows,
    at::IntArrayRef lora_groups, at::IntArrayRef lora_ranks) {
  TORCH_CHECK(weights.size() % kTensorsPerLayer == 0, "step_layers: 18 tensors a layer");
  TORCH_CHECK(layout >= 0 && layout <= 2, "step_layers: layout 0, 1 or 2 (llmq::project's)");
  TORCH_CHECK(activation == kSilu || activation == kGeluTanh, "step_layers: activation 0 or 1");
  TORCH_CHECK(out_features.size() == 4, "step_layers: the qkv, o, gate_up, down widths");
  const int64_t layers = weights.size() / kTensorsPerLayer;
  TORCH_CHECK(cos.size() == sin.size() && static_cast<int64_t>(layer_rotary.size()) == layers,
              "step_layers: a cos and sin per rotary base, a base per layer");
  for (const int64_t r : layer_rotary)
    TORCH_CHECK(r >= 0 && r < static_cast<int64_t>(cos.size()), "step_layers: rotary base");
  check_pools(kv, layers, kv_heads, h_in.scalar_type());
  const Prompts prompts{prompt_starts, prompt_lens, prompt_contexts, prompt_blocks, prompt_masks};
  const int64_t tokens = h_in.size(0), dim = kv[0].size(2);
  const std::vector<KVGroup> groups =
      kv_groups(slots, block_tables, context_lens, windows, prompts, kv[0].size(1), tokens);
  TORCH_CHECK(static_cast<int64_t>(layer_group.size()) == layers,
              "step_layers: a KV group a layer");
  for (const int64_t g : layer_group)
    TORCH_CHECK(g >= 0 && g < static_cast<int64_t>(groups.size()), "step_layers: KV group");
  const Adapters lora{lora_weights, lora_scales, lora_rows, lora_groups, lora_ranks};
  TORCH_CHECK(lora_groups.empty() || lora_weights.size() == 8,
              "step_layers: an A and a B for each of the 4 projections");
  // Each projection's parts' columns (lora_weights.PARTS): q, k, v; o; gate, up; down.
  const int64_t q = heads * dim, kv_width = kv_heads * dim;
  const LayerShape shape{layout,
                         activation,
                         out_features,
                         {{0, q, q + kv_width, q + 2 * kv_width},
                          {0, out_features[1]},
                          {0, out_features[2] / 2, out_features[2]},
                          {0, out_features[3]}},
                         heads,
                         kv_heads,
                         dim,
                         block_size,
                         num_decodes,
                         scale,
                         eps};
  at::Tensor h = h_in;
  at::Tensor attn = at::empty({tokens, heads, dim}, h.options());
  for (int64_t l = 0; l < layers; ++l) {
    const int64_t r = layer_rotary[l];
    h = run_layer(h, weights.data() + l * kTensorsPerLayer, l, cos[r], sin[r], kv[l],
                  groups[layer_group[l]], prompts, attn, shape, lora);
  }
  return h;
}

}  // namespace llmq

TORCH_LIBRARY_FRAGMENT(llmq, m) {
  m.def(
      "step_layers(Tensor h, Tensor[] cos, Tensor[] sin, int[] layer_rotary, Tensor[] weights, "
      "int layout, int activation, int[] out_features, Tensor(a!)[] kv, "
      "Tensor[] slots, int num_decodes, Tensor[] block_tables, Tensor[] context_lens, "
      "int[] windows, int[] layer_group, int[] prompt_starts, int[] prompt_lens, "
      "int[] prompt_contexts, Tensor[] prompt_blocks, Tensor?[] prompt_masks, "
      "int block_size, int heads, int kv_heads, float scale, float eps, Tensor[] lora_weights, "
      "Tensor lora_scales, Tensor lora_rows, int[] lora_groups, int[] lora_ranks) -> Tensor");
  m.impl("step_layers", c10::DispatchKey::CPU, &llmq::step_layers);
  m.impl("step_layers", c10::DispatchKey::MkldnnCPU, &llmq::step_layers);  // packed weights
}
