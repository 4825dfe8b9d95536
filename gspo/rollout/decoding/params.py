"""The sampling settings every draw of a run shares, as one frozen object: `SamplingParams.of(cfg)`."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class SamplingParams:
    """How completions are drawn (`rollout.*`), built once from the config and passed whole to every decoder."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    greedy: bool = False
    keep_topk: int = 0  # rollout.keep_topk: each position's k most likely tokens and their log-probs (not when greedy)
    chat_template: bool = False  # a plain-string prompt is wrapped as one user message (chat messages always are)
    capture_routing: bool = False  # MoE: record the experts every position was routed to, and the routers' log-probs
    compile: bool = False  # hardware.compile: decode through a static KV cache and torch.compile
    engine: str = "hf"  # rollout.engine: gspo's own decoder through the model's forward (hf) or fast_decode (fast)
    matmul: str = "aten"  # rollout.matmul: the fast engine's decode products (aten: F.linear; onednn: reordered copies)
    decode: str = "auto"  # rollout.decode: the fast engine's steps (eager; static cache; graph: replayed on CUDA)

    @staticmethod
    def of(cfg, **changes) -> "SamplingParams":
        """The training sampler's settings in `cfg`, with `changes` (e.g. `capture_routing=True`)."""
        r = cfg.rollout
        return replace(SamplingParams(max_new_tokens=int(r.max_new_tokens), temperature=float(r.temperature),
                                      top_p=float(r.top_p), keep_topk=int(r.keep_topk),
                                      chat_template=bool(cfg.model.use_chat_template),
                                      compile=bool(cfg.hardware.compile), engine=str(r.engine),
                                      matmul=str(r.matmul), decode=str(r.decode)), **changes)

    @property
    def topk(self) -> int:
        """The top-k width kept: none when greedy (no sampling distribution is recorded)."""
        return 0 if self.greedy else self.keep_topk
