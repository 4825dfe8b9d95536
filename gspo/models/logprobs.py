"""Log-probs of chosen tokens and the policy's entropy, straight from the LM head's input.

The naive path, `log_softmax(lm_head(h).float())`, materialises float32 logits, their
log-softmax and (for the entropy) its exp(), each (rows, T, V): at a real vocabulary
(V = 151,936) and 32 rows x 512 tokens that is ~10 GB apiece, and autograd keeps the
logits for backward. Here the LM head is applied chunk by chunk over the selected
positions inside one autograd function that saves only its inputs (hidden states and
the head's weight) and recomputes each chunk's logits in backward, so memory is
O(chunk x V) whatever the batch. The values and gradients are those of the naive path
(tests/models/test_logprobs.py checks both in float64).

`head_logprobs(model, ...)` runs the model once with its LM head swapped (by hooks, for
the call) for that function, so the (rows, T, V) logits are never formed. The forward
still goes through the model's own `__call__`, and so through DDP / FSDP2 wrappers.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

# Logits per chunk: 256 MiB in float32, ~440 rows at V = 151,936. Smaller chunks starve the
# matmuls (the weight gradient's inner dimension is the chunk's rows): at V = 151,936, H = 256,
# 1,024 rows on 2 CPU cores, forward + backward took 2.2x the materialised-logits path with
# 27-row chunks, 1.6x with 110 and 1.1x with 441. A tiny vocabulary takes one chunk.
CHUNK_ELEMENTS = 1 << 26


def _chunk_rows(vocab: int) -> int:
    return max(1, CHUNK_ELEMENTS // max(1, vocab))


def _scaled_logits(hidden: Tensor, weight: Tensor, temperature: float) -> Tensor:
    """float32 (hidden @ weight.T) / temperature; at temperature 1 without the division's pass over (rows, V)."""
    logits = (hidden @ weight.T).float()
    return logits if temperature == 1.0 else logits.div_(temperature)


class _LinearLogProbs(torch.autograd.Function):
    """(hidden (M, H), weight (V, H), targets (M,)) -> log softmax(h W^T / temp)[target] (M,), entropy (M,).

    Backward recomputes each chunk's logits: d logp / d logits = (onehot(target) - p) / temp and, when the
    entropy H = -sum p log p is in the loss (an entropy bonus), d H / d logits = -p (log p + H) / temp.
    """

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float, with_entropy: bool,
                extra: Optional[Tensor] = None):
        M = hidden.shape[0]
        chunk = _chunk_rows(weight.shape[0])
        logp = torch.empty(M, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty(M if with_entropy else 0, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(M, dtype=torch.float32, device=hidden.device)
        # the log-probs of more tokens per position (M, k), no grad: DPPO's top-k divergence reads them
        extra_logp = torch.empty((M, 0) if extra is None else extra.shape, dtype=torch.float32, device=hidden.device)
        for s in range(0, M, chunk):
            logits = _scaled_logits(hidden[s : s + chunk], weight, temperature)
            chosen = logits.gather(-1, targets[s : s + chunk, None]).squeeze(-1)
            more = logits.gather(-1, extra[s : s + chunk]) if extra is not None else None
            if with_entropy:  # lse and H from one exp pass: with e = exp(z - m), S = sum e,
                m = logits.amax(-1, keepdim=True)  # lse = m + log S and H = log S - sum(e (z - m)) / S
                z = logits.sub_(m)
                e = z.exp()
                total = e.sum(-1)
                log_total = total.log()
                lse_c = m.squeeze(-1) + log_total  # logsumexp's own steps: bitwise its value on the CPUs tried
                entropy[s : s + chunk] = log_total - torch.linalg.vecdot(e, z) / total
            else:
                lse_c = logits.logsumexp(-1)
            lse[s : s + chunk] = lse_c
            logp[s : s + chunk] = chosen - lse_c
            if more is not None:
                extra_logp[s : s + chunk] = more - lse_c[:, None]
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)  # lse: backward's softmax is one exp
        ctx.temperature = temperature
        ctx.mark_non_differentiable(extra_logp)
        ctx.set_materialize_grads(False)  # an entropy no loss uses gets None in backward: no extra work
        return logp, entropy, extra_logp

    @staticmethod
    def backward(ctx, grad_logp: Optional[Tensor], grad_entropy: Optional[Tensor],
                 _grad_extra: Optional[Tensor] = None):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        chunk = _chunk_rows(weight.shape[0])
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        if grad_logp is None:
            grad_logp = torch.zeros_like(lse)
        for s in range(0, hidden.shape[0], chunk):
            h = hidden[s : s + chunk]
            log_p = _scaled_logits(h, weight, ctx.temperature).sub_(lse[s : s + chunk, None])
            g = log_p.exp()  # softmax
            if grad_entropy is not None:  # the entropy bonus: dL/dH * dH/dz, dH/dz = -p (log p + H)
                dh = g * log_p.add_(entropy[s : s + chunk, None])
            g.scatter_add_(-1, targets[s : s + chunk, None], -torch.ones_like(g[:, :1]))  # softmax - onehot
            g.mul_((grad_logp[s : s + chunk] / -ctx.temperature)[:, None])  # (onehot - softmax) * dL/dlogp / T
            if grad_entropy is not None:
                g.sub_(dh.mul_((grad_entropy[s : s + chunk] / ctx.temperature)[:, None]))
            g = g.to(weight.dtype)
            if need_h:
                grad_h[s : s + chunk] = g @ weight
            if need_w:  # accumulated in float32 over chunks, cast once
                if g.dtype == torch.float32:
                    grad_w.addmm_(g.T, h)
                else:
                    grad_w += (g.T @ h).float()
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None


def selected_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float = 1.0,
                      with_entropy: bool = False, extra: Optional[Tensor] = None):
    """Log-probs (M,) of `targets` under softmax(hidden @ weight.T / temperature), chunked over rows.

    hidden (M, H) carries the gradient to the model, weight (V, H) is the LM head's; float32
    results. With `with_entropy`, also the entropy (M,) of that distribution (with its gradient). With
    `extra` (M, k) token ids, a third result: their log-probs (M, k), without grad.
    """
    logp, entropy, extra_logp = _LinearLogProbs.apply(hidden, weight, targets, float(temperature), with_entropy,
                                                      extra)
    out = (logp, entropy if with_entropy else None)
    return out if extra is None else (*out, extra_logp)


def head_logprobs(model: nn.Module, select: Tensor, targets: Tensor, temperature: float = 1.0,
                  with_entropy: bool = False, extra: Optional[Tensor] = None,
                  **forward_kwargs) -> tuple[Tensor, Optional[Tensor], object]:
    """One forward of `model` (or its DDP / FSDP2 wrapper) whose LM head returns log-probs, not logits.

    select: (B, K) bool over the K positions the head sees (`logits_to_keep` in forward_kwargs);
    targets: (M,) the token each selected position is scored on, M = select.sum(). Returns
    (log-probs (M,), entropies (M,) or None, the model output); with `extra` (M, k) token ids, a
    fourth: their log-probs (M, k), without grad.

    Hooks on the head replace its output by `selected_logprobs` of its input and its own
    weight, inside the model's call: under FSDP2 the weight is unsharded there, and the
    log-probs leave as the model's `logits`, an output FSDP's backward hooks watch. The real
    head gets an empty slice, so the (B, K, V) logits are never formed. Assumes the model
    returns its head's output unchanged as `logits` (Qwen3, Qwen3-MoE, Llama, Mistral, ...).
    A model that transforms them (Gemma 2's soft-capping, Granite's and Cohere's scaling: found
    by `check_head`), or whose head has a bias (Phi-2), takes the plain path instead: its own
    logits, at the selected positions.
    """
    bare = getattr(model, "module", model)  # DDP keeps the model as .module; FSDP2 shards it in place
    head = bare.get_output_embeddings()
    if not getattr(head, PASSES_THROUGH, True) or getattr(head, "bias", None) is not None:
        return _plain_logprobs(model, select, targets, temperature, with_entropy, extra, **forward_kwargs)
    hidden: list = []
    entropy: list = []
    more: list = []

    def take_input(module, args):
        if hidden:
            raise RuntimeError("the LM head ran twice in one forward pass")
        hidden.append(args[0])
        return (args[0][..., :0, :],)  # (B, 0, H): the head computes no logits

    def give_logprobs(module, args, output):
        logp, ent, *rest = selected_logprobs(hidden[0][select], module.weight, targets, temperature, with_entropy,
                                             extra)
        entropy.append(ent)
        more.extend(rest)
        return logp

    handles = [head.register_forward_pre_hook(take_input), head.register_forward_hook(give_logprobs)]
    try:
        out = model(**forward_kwargs)
    finally:
        for h in handles:
            h.remove()
    return (out.logits, entropy[0], out) if extra is None else (out.logits, entropy[0], out, more[0])


# Set on the LM head by check_head: whether the model returns the head's output unchanged as its logits.
# An attribute of the module, so that copies (the reference model, a sampler copy) and wrappers keep it.
PASSES_THROUGH = "gspo_passes_through"


@torch.no_grad()
def check_head(model: nn.Module) -> bool:
    """Whether `model` returns its LM head's output as its logits unchanged; remembered for `head_logprobs`.

    One forward of 4 tokens whose head output is replaced by values up to +-50 (so that a
    soft-cap at 30, a scale or a bias all show): they must come back bit for bit. Run it
    once after loading, outside any routing capture (it is a forward like any other).
    """
    head = model.get_output_embeddings()
    probe: list = []

    def replace(module, args, output):
        probe.append(torch.linspace(-50, 50, output.numel(), device=output.device).view_as(output).to(output.dtype))
        return probe[0]

    handle = head.register_forward_hook(replace)
    was_training = model.training
    model.eval()
    try:
        vocab = model.get_input_embeddings().weight.shape[0]
        ids = torch.arange(4, device=head.weight.device)[None] % vocab
        out = model(input_ids=ids, use_cache=False).logits
    finally:
        handle.remove()
        model.train(was_training)
    passes = bool(probe) and out.shape == probe[0].shape and torch.equal(out, probe[0])
    setattr(head, PASSES_THROUGH, passes)
    return passes


def _plain_logprobs(model: nn.Module, select: Tensor, targets: Tensor, temperature: float, with_entropy: bool,
                    extra: Optional[Tensor] = None, **forward_kwargs):
    """`head_logprobs` from the model's own (B, K, V) logits: right for any post-head transform, O(B K V) memory."""
    out = model(**forward_kwargs)
    logits = out.logits[select].float() / temperature  # (M, V)
    logp_all = torch.log_softmax(logits, dim=-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1) if with_entropy else None
    logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)
    if extra is None:
        return logp, entropy, out
    return logp, entropy, out, logp_all.detach().gather(-1, extra)
