"""Train and export the tiny model that minioverlap ships (`LLM(model="tiny")`).

    python tools/make_model.py --out minioverlap/checkpoints/tiny          # on a GPU: about two minutes
    python tools/make_model.py --out /tmp/tiny --steps 20 --device cpu     # a smoke run

Every step is deterministic given the corpus (this interpreter's standard library) and the seed:
1. corpus: every .py file of the standard library and its tests (or of --corpus), in sorted order; one file in 50
   (by a hash of its path) is held out for evaluation;
2. tokenizer: byte-level BPE (the `tokenizers` library) with 4096 tokens; `<|endoftext|>` ends a file;
3. model: a Qwen3 decoder (minioverlap.model.qwen3) plus one MTP layer (DeepSeek-V3 layout, below),
   trained jointly: loss = CE(next token) + mtp_weight * CE(token after next);
4. export: config.json, generation_config.json, tokenizer.json, model.safetensors (bf16) and a model
   card (README.md) with the corpus, seed, steps, losses, a sample and the MTP accept length.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from minioverlap.model.qwen3 import (AttentionContext, DecoderLayer, Qwen3Config, Qwen3ForCausalLM,  # noqa: E402
                                     RMSNorm, rope_cos_sin)

EOS = "<|endoftext|>"
SAMPLE_PROMPTS = ["def fibonacci(n):", "class Stack:\n    def __init__(self):", "import os\n\ndef list_files(path):",
                  "def is_prime(n):\n    ", "    def __repr__(self):"]


def corpus_files(root: Path) -> tuple[list[Path], list[Path]]:
    """(train, held-out) .py files under root (the standard library and its tests), in sorted order."""
    train, held_out = [], []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if "site-packages" in parts:
            continue
        digest = hashlib.sha256("/".join(parts).encode()).digest()
        (held_out if digest[0] % 50 == 0 else train).append(path)
    if not held_out:                  # a small corpus: hold out its last file
        held_out.append(train.pop())
    return train, held_out


def read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def train_tokenizer(files: list[Path], vocab_size: int) -> Tokenizer:
    """Byte-level BPE: any byte string encodes, and decoding gives the exact text back."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((read(p) for p in files), trainer=trainer)
    return tok


def encode(tok: Tokenizer, files: list[Path]) -> torch.Tensor:
    """All files as one token stream, each file followed by EOS."""
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for encoding in tok.encode_batch([read(p) for p in files]):
        ids.extend(encoding.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


# The MTP layer, DeepSeek-V3 layout (DeepSeek-V3 technical report, section 2.2). One extra decoder layer
# predicts the token after next: for position i it mixes the main model's final hidden state h[i] with
# the embedding of token i+1, runs a decoder layer with its own attention, and scores with the shared
# head. Chapter 09 serves it; this is the definition it is trained with.

class SharedHead(nn.Module):
    """Holds only the norm: the head's matrix is the main model's lm_head."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class MTPLayer(DecoderLayer):
    """A decoder layer with an input mixer (enorm, hnorm, eh_proj) and an output norm."""

    def __init__(self, config: Qwen3Config, layer_id: int) -> None:
        super().__init__(config, layer_id)
        self.enorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hnorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.shared_head = SharedHead(config)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                ctx: AttentionContext) -> torch.Tensor:
        """embeds of tokens i+1 and main hidden states of tokens i, [T, H] each -> MTP hidden [T, H]."""
        x = self.eh_proj(torch.cat((self.enorm(embeds), self.hnorm(hidden)), dim=-1))
        return self.shared_head.norm(super().forward(x, cos, sin, ctx))


class CausalBatch:
    """Attention context for training: B rows of T tokens, flattened to [B*T] as the model expects."""

    def __init__(self, batch: int, seq_len: int) -> None:
        self.batch, self.seq_len = batch, seq_len

    def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.view(self.batch, self.seq_len, t.shape[1], t.shape[2]).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return out.transpose(1, 2).reshape(self.batch * self.seq_len, out.shape[1], out.shape[3])


class TinyWithMTP(torch.nn.Module):
    """The main model and its MTP layer, with the joint loss."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.lm = Qwen3ForCausalLM(config)
        self.mtp = MTPLayer(config, layer_id=config.num_hidden_layers)

    def losses(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [B, T+1] -> (main loss predicting t+1, MTP loss predicting t+2)."""
        B, T = tokens.shape[0], tokens.shape[1] - 1
        inputs = tokens[:, :-1]
        positions = torch.arange(T, device=tokens.device).repeat(B)
        hidden = self.lm(inputs.reshape(-1), positions, CausalBatch(B, T))
        main = F.cross_entropy(self.lm.compute_logits(hidden), tokens[:, 1:].reshape(-1))
        # MTP at position i: main hidden of token i and embedding of token i+1 -> token i+2.
        h = hidden.view(B, T, -1)[:, :-1].reshape(B * (T - 1), -1)
        emb = self.lm.model.embed_tokens(tokens[:, 1:T]).reshape(B * (T - 1), -1)
        mtp_pos = torch.arange(1, T, device=tokens.device).repeat(B)
        cos, sin = rope_cos_sin(mtp_pos, self.lm.config.head_dim, self.lm.config.rope_theta)
        out = self.mtp(emb, h, cos, sin, CausalBatch(B, T - 1))
        mtp = F.cross_entropy(self.lm.compute_logits(out), tokens[:, 2:].reshape(-1))
        return main, mtp


def batches(data: torch.Tensor, batch: int, seq_len: int, gen: torch.Generator):
    while True:
        starts = torch.randint(0, len(data) - seq_len - 1, (batch,), generator=gen)
        yield torch.stack([data[s:s + seq_len + 1] for s in starts.tolist()])


@torch.no_grad()
def evaluate(net: TinyWithMTP, data: torch.Tensor, seq_len: int, device: str) -> tuple[float, float]:
    """Mean main and MTP loss over consecutive windows of the held-out stream."""
    net.eval()
    n = (len(data) - 1) // seq_len
    windows = torch.stack([data[i * seq_len:i * seq_len + seq_len + 1] for i in range(n)])
    main_sum = mtp_sum = 0.0
    for chunk in windows.split(32):
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=device == "cuda"):
            main, mtp = net.losses(chunk.to(device))
        main_sum, mtp_sum = main_sum + main.item() * len(chunk), mtp_sum + mtp.item() * len(chunk)
    net.train()
    return main_sum / n, mtp_sum / n


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))     # cosine down to 10%


def train(net: TinyWithMTP, data: torch.Tensor, held: torch.Tensor, args: argparse.Namespace) -> list[tuple[int, float, float]]:
    """AdamW with warmup and cosine decay; with --eval-every, keeps the weights of the best held-out loss."""
    gen = torch.Generator().manual_seed(args.seed)
    best = (float("inf"), -1, None)
    opt = torch.optim.AdamW(net.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=args.device == "cuda")
    log = []
    for step, tokens in zip(range(args.steps), batches(data, args.batch, args.seq_len, gen)):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        with torch.autocast(device_type=args.device, dtype=torch.bfloat16, enabled=args.device == "cuda"):
            main, mtp = net.losses(tokens.to(args.device))
        loss = main + args.mtp_weight * mtp
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step == args.steps - 1:
            log.append((step, main.item(), mtp.item()))
            print(f"step {step:5d}  loss {main.item():.3f}  mtp {mtp.item():.3f}", flush=True)
        if args.eval_every and step % args.eval_every == args.eval_every - 1:
            held_main, held_mtp = evaluate(net, held, args.seq_len, args.device)
            print(f"step {step:5d}  held-out loss {held_main:.3f}  mtp {held_mtp:.3f}", flush=True)
            if held_main < best[0]:
                best = (held_main, step, {k: v.detach().clone() for k, v in net.state_dict().items()})
    if best[2] is not None:
        print(f"keeping the weights of step {best[1]} (held-out loss {best[0]:.3f})", flush=True)
        net.load_state_dict(best[2])
        args.kept_step = best[1]
    return log


@torch.no_grad()
def greedy(net: TinyWithMTP, prompt: list[int], max_tokens: int, device: str) -> list[int]:
    """Plain greedy decoding, recomputing the whole sequence each step (no cache: this is a check)."""
    ids = list(prompt)
    for _ in range(max_tokens):
        hidden = net.lm(torch.tensor(ids, device=device), torch.arange(len(ids), device=device), CausalBatch(1, len(ids)))
        ids.append(int(net.lm.compute_logits(hidden[-1:]).argmax()))
    return ids[len(prompt):]


@torch.no_grad()
def accept_length(net: TinyWithMTP, prompt: list[int], max_tokens: int, drafts: int, device: str) -> tuple[float, list[int]]:
    """Greedy speculative decoding with the MTP layer drafting `drafts` tokens a step.

    A step: the main model's next token (the bonus) is certain; the MTP layer drafts `drafts` more,
    feeding its own output back as the hidden state, over the whole sequence (so it sees its own context,
    as its KV cache would give it); one main pass verifies them and the agreeing prefix is kept. The
    accept length is tokens gained per step (1 + accepted drafts); the tokens equal plain greedy's.
    """
    lm, mtp, c = net.lm, net.mtp, net.lm.config
    ids, steps = list(prompt), 0

    def run(tokens: list[int]) -> torch.Tensor:
        return lm(torch.tensor(tokens, device=device), torch.arange(len(tokens), device=device), CausalBatch(1, len(tokens)))

    while len(ids) - len(prompt) < max_tokens:
        n = len(ids)
        hidden = run(ids)
        seq = ids + [int(lm.compute_logits(hidden[-1:]).argmax())]
        hs = hidden
        for _ in range(drafts):
            m = len(seq) - 1            # MTP position j (1..m) reads token seq[j] and hidden hs[j-1]
            cos, sin = rope_cos_sin(torch.arange(1, m + 1, device=device), c.head_dim, c.rope_theta)
            out = mtp(lm.model.embed_tokens(torch.tensor(seq[1:], device=device)), hs[:m], cos, sin, CausalBatch(1, m))
            seq.append(int(lm.compute_logits(out[-1:]).argmax()))
            hs = torch.cat((hidden, out[n - 1:]), dim=0)   # past the prompt, the MTP output is the hidden
        target = lm.compute_logits(run(seq)[n:n + drafts]).argmax(-1).tolist()
        accepted = 0
        while accepted < drafts and seq[n + 1 + accepted] == target[accepted]:
            accepted += 1
        ids = seq[:n + 1 + accepted]
        steps += 1
    return (len(ids) - len(prompt)) / steps, ids[len(prompt):len(prompt) + max_tokens]


def export(net: TinyWithMTP, tok: Tokenizer, out: Path) -> None:
    """HF-format checkpoint: the main model under its transformers names, the MTP layer after it."""
    c = net.lm.config
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v for k, v in net.lm.state_dict().items() if k != "lm_head.weight"}
    state |= {f"model.layers.{c.num_hidden_layers}.{k}": v for k, v in net.mtp.state_dict().items()}
    save_file({k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in state.items()}, out / "model.safetensors",
              metadata={"format": "pt"})
    eos = tok.token_to_id(EOS)
    config = {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim, "hidden_act": "silu",
        "max_position_embeddings": c.max_position_embeddings, "rms_norm_eps": c.rms_norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta}, "rope_theta": c.rope_theta,
        "tie_word_embeddings": True, "attention_bias": False, "use_sliding_window": False,
        "bos_token_id": eos, "eos_token_id": eos, "dtype": "bfloat16", "num_nextn_predict_layers": 1,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos, "bos_token_id": eos}, indent=2) + "\n")
    tok.save(str(out / "tokenizer.json"))
    write_tokenizer_config(out)


# ChatML, the chat format Qwen's models use: each message between <|im_start|>role and <|im_end|>, then, with
# add_generation_prompt, the opening of the assistant's turn. The tokenizer has one special token
# (<|endoftext|>): the markers are encoded as ordinary text, a few byte-level tokens each.
CHAT_TEMPLATE = ("{%- for message in messages %}"
                 "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
                 "{%- endfor %}"
                 "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def write_tokenizer_config(out: Path) -> None:
    """tokenizer_config.json: what transformers' AutoTokenizer needs beside tokenizer.json, and the chat
    template that `minioverlap serve` renders for /v1/chat/completions (apply_chat_template)."""
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "clean_up_tokenization_spaces": False,
              "chat_template": CHAT_TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def model_card(args: argparse.Namespace, facts: dict) -> str:
    """The README beside the weights: what the model is, how it was made, what it reaches."""
    log = "\n".join(f"| {s} | {m:.3f} | {t:.3f} |" for s, m, t in facts["log"])
    return f"""# tiny: the model minioverlap ships

A Qwen3-architecture decoder with one MTP layer (DeepSeek-V3 layout), trained from scratch on the Python
standard library by `tools/make_model.py`. It exists so that every chapter runs with no network: it
writes recognisable Python, not good Python.

| | |
|---|---|
| parameters | {facts['params_main'] / 1e6:.2f}M main + {facts['params_mtp'] / 1e6:.2f}M MTP layer |
| shape | hidden {args.hidden}, {args.layers} layers, {args.heads} query heads, {args.kv_heads} KV heads, head_dim 64, MLP {args.hidden * 3}, vocabulary {args.vocab} (byte-level BPE), tied embedding and head |
| corpus | {args.corpus_name}: {facts['train_files']} files ({facts['train_tokens']:,} tokens) for training, {facts['held_files']} held out ({facts['held_tokens']:,} tokens) |
| training | seed {args.seed}, {args.steps} steps (weights kept from step {getattr(args, "kept_step", args.steps - 1)}, the best held-out loss) of {args.batch} x {args.seq_len} tokens, AdamW (peak lr {args.lr}, warmup {args.warmup}, cosine), bf16 autocast, loss = main + {args.mtp_weight} x MTP, on {facts['device_name']} in {facts['seconds']:.0f} s |
| held-out loss | main {facts['held_main']:.3f} nats/token, MTP (token after next) {facts['held_mtp']:.3f} |
| MTP accept length | {facts['accept']:.2f} tokens per verify step, greedy, {args.drafts} draft tokens, {len(SAMPLE_PROMPTS)} code prompts x {args.accept_tokens} tokens, by this script's `accept_length` |
| stored as | bf16 safetensors; the MTP layer is `model.layers.{args.layers}.*` (enorm, hnorm, eh_proj, self_attn, mlp, shared_head.norm) |

The MTP layer mixes `enorm(embed(token i+1))` and `hnorm(h_i)` (in that order), where `h_i` is the main
model's final hidden state after its last norm, and sits at position i+1. transformers loads the main
model with `AutoModelForCausalLM.from_pretrained` (it reports the MTP tensors as unused).

tokenizer_config.json holds a ChatML chat template (Qwen's format: `<|im_start|>role\\ncontent<|im_end|>\\n`
per message, then `<|im_start|>assistant\\n`), so that `/v1/chat/completions` serves this model. The
tokenizer's only special token is `<|endoftext|>`: the markers are encoded as ordinary text (a few
byte-level tokens each), and the model was never trained on chats, so its answers are Python, not replies.

Made with `python tools/make_model.py {facts['command']}` ({facts['python']}, torch {torch.__version__}).

## A greedy sample

Prompt `def fibonacci(n):`, 64 tokens:

```python
{facts['sample']}
```

## Training loss

| step | main | MTP |
|---|---|---|
{log}
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--corpus", type=Path, default=Path(sysconfig.get_paths()["stdlib"]),
                   help="a folder of .py files (default: this interpreter's standard library)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--mtp-weight", type=float, default=1.0)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--drafts", type=int, default=3)
    p.add_argument("--accept-tokens", type=int, default=96)
    p.add_argument("--eval-every", type=int, default=250, help="held-out loss every N steps (0: never)")
    p.add_argument("--corpus-name", default=f"the standard library of Python {platform.python_version()} with its tests",
                   help="how the model card names the corpus")
    args = p.parse_args()
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    start = time.time()
    train_files, held_files = corpus_files(args.corpus)
    tok = train_tokenizer(train_files, args.vocab)
    train_data, held_data = encode(tok, train_files), encode(tok, held_files)
    print(f"corpus: {len(train_files)} files, {len(train_data):,} tokens; held out {len(held_data):,}", flush=True)
    config = Qwen3Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, head_dim=64, eos_token_ids=(tok.token_to_id(EOS),),
                         num_nextn_predict_layers=1)
    net = TinyWithMTP(config)
    for name, param in net.named_parameters():
        if param.dim() == 2:
            torch.nn.init.normal_(param, std=0.02)
    net.to(args.device)
    log = train(net, train_data, held_data, args)
    seconds = time.time() - start
    held_main, held_mtp = evaluate(net, held_data, args.seq_len, args.device)
    net.eval()
    results = [accept_length(net, tok.encode(p).ids, args.accept_tokens, args.drafts, args.device) for p in SAMPLE_PROMPTS]
    same = sum(ids == greedy(net, tok.encode(p).ids, args.accept_tokens, args.device) for p, (_, ids) in zip(SAMPLE_PROMPTS, results))
    print(f"speculative tokens equal plain greedy on {same} of {len(SAMPLE_PROMPTS)} prompts", flush=True)
    accept = sum(r[0] for r in results) / len(results)
    sample_ids = greedy(net, tok.encode(SAMPLE_PROMPTS[0]).ids, 64, args.device)
    sample = SAMPLE_PROMPTS[0] + tok.decode(sample_ids)
    print(f"held-out loss {held_main:.3f}, mtp {held_mtp:.3f}, accept length {accept:.2f}\n{sample}", flush=True)
    export(net, tok, args.out)
    n_main = sum(p.numel() for p in net.lm.parameters())
    facts = dict(log=log, seconds=seconds, held_main=held_main, held_mtp=held_mtp, accept=accept, sample=sample,
                 params_main=n_main, params_mtp=sum(p.numel() for p in net.mtp.parameters()),
                 train_files=len(train_files), held_files=len(held_files), train_tokens=len(train_data),
                 held_tokens=len(held_data), command=" ".join(sys.argv[1:]), python=f"Python {platform.python_version()}",
                 device_name=torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "CPU")
    (args.out / "README.md").write_text(model_card(args, facts))


if __name__ == "__main__":
    main()
