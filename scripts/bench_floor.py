"""The floor: what one RL step of a given shape costs at the least, and gspo's overhead over it (CPU).

The floor is the bare work an RL step cannot avoid, on the same model, prompts and shapes
as `gspo train` (the same `--variant`s as bench_vs_trl.py):
  sampling: one prefill (logits only at the last position), then one forward per new token
            over the KV cache (through gspo's fast engine where `rollout.engine` picks it, as gspo's
            sampler does), multinomial draws, an early exit when every row has its EOS;
  update:   per minibatch one forward with logits only at the completion positions, the sampled
            tokens' log-probs (cross-entropy), a GSPO-shaped loss (sequence mean of log-probs x a
            fixed +-1 advantage; plus the MoE aux loss where gspo adds it), backward, gradient
            clipping and one AdamW step (fused, as gspo's).
No old-policy pass (sampler log-probs can stand in for it), no entropy, no statistics, no
rewards. gspo's time per step is `time/step_s`; the table shows gspo / floor.
Runs alternate floor, gspo, floor, gspo, ... each in a fresh subprocess; with `--trl` TRL's `GRPOTrainer` on the
same work joins the alternation (bench_vs_trl.py's TRL side), so floor / TRL and gspo / TRL come from one sitting.

Usage (repository root, in the venv):
  python scripts/bench_floor.py --variant long64
  python scripts/bench_floor.py --variant vocab --override rollout.old_logprobs=sampler
  python scripts/bench_floor.py --variant long64 --override rollout.engine=fast
  python scripts/bench_floor.py --variant toy --trl --rounds 4
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_common import (
    Run,
    attention,
    describe_work,
    fmt,
    gspo_overrides,
    markdown_table,
    pooled,
    ratio,
    run_benchmark,
    run_worker,
    versions,
)
from bench_workers import gspo_side, trl_side

from gspo.rollout.decoding.fast_decode import FastDecoder, resolve

HERE = Path(__file__).resolve()


# --------------------------------------------------------------------------- the floor's own minimal step


def left_pad(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def positions(mask: torch.Tensor) -> torch.Tensor:
    return (mask.cumsum(-1) - 1).clamp(min=0)


@torch.no_grad()
def sample(model, ids: torch.Tensor, mask: torch.Tensor, max_new: int, eos: int, pad: int,
           temperature: float, gen: torch.Generator, engine: str = "hf") -> tuple[torch.Tensor, torch.Tensor]:
    """(completion ids (N, T'), completion mask (N, T'): 1 up to and including each row's first EOS).

    `engine` `fast`: the decode steps through gspo's fast engine (gspo/rollout/decoding/fast_decode.py), as gspo's
    sampler runs them under `rollout.engine=fast`, so the floor stays the plainest code on the same engine.
    """
    n, p = ids.shape
    full_mask = torch.cat([mask, torch.ones(n, max_new, dtype=mask.dtype)], 1)  # allocated once
    pos = positions(mask)[:, -1:]
    out = torch.full((n, max_new), pad, dtype=torch.long)
    done = torch.zeros(n, dtype=torch.bool)
    res = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask), use_cache=True, logits_to_keep=1)
    logits = res.logits[:, -1]
    fast = FastDecoder(model, res.past_key_values, p + max_new) if engine == "fast" else None
    for t in range(max_new):
        probs = torch.softmax(logits.float() / temperature, -1)
        nxt = torch.where(done, pad, torch.multinomial(probs, 1, generator=gen).squeeze(-1))
        out[:, t] = nxt
        done |= nxt == eos
        if t == max_new - 1 or bool(done.all()):
            break
        if fast is not None:
            logits = fast.step(nxt[:, None], pos + t + 1, full_mask[:, : p + t + 1])
        else:
            res = model(input_ids=nxt[:, None], attention_mask=full_mask[:, : p + t + 1], position_ids=pos + t + 1,
                        past_key_values=res.past_key_values, use_cache=True)
            logits = res.logits[:, -1]
    out = out[:, : t + 1]
    is_eos = (out == eos).long()
    return out, ((is_eos.cumsum(-1) - is_eos) == 0).float()


def completion_logprobs(model, ids: torch.Tensor, mask: torch.Tensor, prompt_len: int, temperature: float = 1.0,
                        **forward_kwargs) -> tuple[torch.Tensor, object]:
    """Log-probs (N, T) of the completion tokens ids[:, prompt_len:] (with grad), and the model output."""
    t = ids.shape[1] - prompt_len
    res = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask), logits_to_keep=t + 1,
                use_cache=False, **forward_kwargs)
    logits = res.logits[:, :-1].float() / temperature
    target = ids[:, prompt_len:]
    logp = -F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="none")
    return logp.view_as(target), res


def floor_worker(spec: dict) -> None:
    """The floor's RL steps on the work of spec["overrides"]; writes per-step seconds to spec["out"]."""
    torch.set_num_threads(spec["threads"])
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gspo.config.loading import compose
    from gspo.tasks import build_task

    cfg = compose(spec["overrides"])
    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32,
                                                 attn_implementation=attention(cfg, "cpu", torch.float32))
    tok = AutoTokenizer.from_pretrained(cfg.model.path)
    task = build_task(cfg.task)
    G, T, M, temp = cfg.rollout.group_size, cfg.rollout.max_new_tokens, cfg.train.minibatches, cfg.rollout.temperature
    aux = cfg.model.router_aux_loss_coef if hasattr(model.config, "output_router_logits") else 0.0
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay, fused=True)
    gen = torch.Generator().manual_seed(cfg.seed)
    engine = resolve(cfg.rollout.engine, model, cfg.hardware.compile)  # the decode engine gspo's sampler uses
    res = {"steps": [], "sample_s": [], "update_s": [], "len_mean": []}
    for step in range(1, cfg.train.steps + 1):
        problems = task.sample_train(random.Random(f"{cfg.seed}-{step}"), cfg.rollout.prompts_per_step)
        t0 = time.perf_counter()
        prompts = [tok(p.prompt, add_special_tokens=False)["input_ids"] for p in problems for _ in range(G)]
        ids, mask = left_pad(prompts, tok.pad_token_id)
        model.eval()
        comp, comp_mask = sample(model, ids, mask, T, tok.eos_token_id, tok.pad_token_id, temp, gen, engine)
        t1 = time.perf_counter()
        model.train()
        seq, seq_mask = torch.cat([ids, comp], 1), torch.cat([mask, comp_mask.long()], 1)
        adv = torch.tensor([1.0, -1.0]).repeat(len(prompts) // 2 + 1)[: len(prompts)]
        for rows in torch.arange(len(prompts)).chunk(M):
            logp, out = completion_logprobs(model, seq[rows], seq_mask[rows], ids.shape[1], temp,
                                            **({"output_router_logits": True} if aux else {}))
            m = comp_mask[rows]
            loss = -(adv[rows] * (logp * m).sum(-1) / m.sum(-1).clamp(min=1)).mean()
            if aux:
                loss = loss + aux * out.aux_loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        res["steps"].append(t2 - t0)
        res["sample_s"].append(t1 - t0)
        res["update_s"].append(t2 - t1)
        res["len_mean"].append(comp_mask.sum(-1).mean().item())
    Path(spec["out"]).write_text(json.dumps(res))


# --------------------------------------------------------------------------- driver


def sides(a, model_dir: Path) -> dict:
    spec = {"overrides": gspo_overrides(a, model_dir), "threads": a.threads}
    from gspo.config.loading import compose

    if compose(spec["overrides"]).model.lora.r > 0:
        raise SystemExit("the floor trains every weight: it has no LoRA counterpart (use --variant smollm2)")

    def floor(work: Path) -> Run:
        res, rss, others = run_worker("floor", HERE, spec, work, a.wait_idle)
        return Run(res.pop("steps"), rss, others, res)

    def gspo(work: Path) -> Run:
        run = gspo_side(spec, a.wait_idle)(work)
        run.extra["sample_s"] = run.extra["rollout_s"]  # the floor's name for it
        return run

    out = {"floor": floor, "gspo": gspo}
    if a.trl:
        out = {"trl": trl_side(spec, a.wait_idle), **out}
    return out


def more_args(p) -> None:
    p.add_argument("--trl", action="store_true",
                   help="a third side: TRL's GRPOTrainer on the same work (needs trl), for floor / TRL and gspo / TRL")


def table(results: dict[str, list[Run]], a) -> str:
    med = {k: [statistics.median(pooled(runs, key)) if key is None or key in runs[0].extra else None
               for key in (None, "sample_s", "update_s")]  # TRL's step is not split into sampling and update
           for k, runs in results.items()}
    rss = {k: max(r.rss_mib for r in runs) for k, runs in results.items()}
    rows = []
    for kind, name in (("trl", "TRL GRPOTrainer"), ("floor", "floor (bare sampling + bare updates)"),
                       ("gspo", "gspo train")):
        if kind in results:
            rows.append([name, *map(fmt, med[kind]), fmt(statistics.mean(pooled(results[kind], "len_mean")), 1),
                         f"{rss[kind]:,.0f}"])
    for num, den in (("gspo", "floor"), ("floor", "trl"), ("gspo", "trl")):
        if den in results:
            label = f"**{num} / {'TRL' if den == 'trl' else den}**"
            rows.append([label, *(ratio(g, f) for g, f in zip(med[num], med[den])), "", ratio(rss[num], rss[den])])
    header = ["", "median s/step", "median sampling s", "median update s", "mean completion length", "peak RSS (MiB)"]
    work = describe_work(a, ", ".join(results))
    note = ("gspo's sampling column is `time/rollout_s` (sampling, decoding, rewards); its update column is "
            "`time/update_s` (old-policy log-probs if recomputed, the minibatch updates, MoE statistics).")
    added = " ".join(a.override) or "none"
    return "\n".join([f"Work: {work}.", f"gspo overrides added: {added}.", "", markdown_table(header, rows), "",
                      note, f"Versions: {versions(a.threads)}."])


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "floor":
        floor_worker(json.loads(Path(sys.argv[2]).read_text()))
    else:
        run_benchmark(__doc__.split("\n\n")[0], sides, table, "bench-floor-", more_args)
