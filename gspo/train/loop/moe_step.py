"""The loop's MoE component: what an RL step does for a Mixture-of-Experts model, in one place.

The loop calls it at fixed points and never asks which model family it runs; for a
dense model every call is a no-op (`MoEStep.for_model` returns the inert base class):

    sample_kwargs()                     generate(): record the routing seen while sampling
    old_pass(model, rollout, record)    around the trainer's log-prob pass on the rollout: the old
                                        policy's (record) or a mismatch diagnostic only
    minibatch(model, rollout, rows)     around each update's forward and backward: yields a
        .router_shift(...)              RSPO's factor for the loss (None: no RSPO)
        .aux_loss(...)                  the load-balancing loss to add (0: none)
        .stats()                        per-minibatch diagnostics
    end_step(model, rollout, step)      routing statistics of the updated policy

Routing Replay (design.md section 3): R2 replays the old policy's top-k in the update
passes, R3 the routing seen while sampling; both keep the live router softmax as the
expert weights, so the router still learns. Under R3 the old-policy pass replays too, so
that at the old weights every ratio is exactly 1 (issue: with live routing there, bf16
routing flips made ratio != 1 before any update). When the sampler's log-probs serve as
the old policy's (`rollout.old_logprobs=sampler`) no old-policy pass runs: the routing
recorded while sampling is the old policy's routing, so R2 and R3 replay the same thing.
With a sampler that is not the trainer (`rollout.dtype`, gspo/rollout/decoding/sampler.py) the two differ: R3
replays the routing the sampler's copy chose, R2 the trainer's recomputed pass's.
`rollout/routing_mismatch` counts the (token, layer) top-k sets on which they disagree.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

from gspo.algos.losses import get_loss
from gspo.algos.mismatch import routing_mismatch
from gspo.models import moe
from gspo.models.packing import Packing
from gspo.rollout.decoding.generate import Rollout, position_ids
from gspo.rollout.decoding.sampler import separate


class _NoMinibatch:
    """A dense model's minibatch: no router shift, no aux loss, no stats."""

    def router_shift(self, sub: Rollout) -> Optional[torch.Tensor]:
        return None

    def aux_loss(self, sub: Rollout) -> torch.Tensor | float:
        return 0.0

    def stats(self) -> dict[str, float]:
        return {}


class MoEStep:
    """The no-op component (dense models); `for_model` picks the MoE one when the model has routers."""

    @staticmethod
    def for_model(model: torch.nn.Module, cfg, dist, old_pass: bool) -> "MoEStep":
        """The component for this run: `_MoE` for a model with top-k routers, else this inert base.

        Refuses (ConfigError, one line) a router that `moe.routing_replay` cannot replay;
        experts whose routing gspo cannot read are refused for replay, else noted (and
        trained with this inert base).
        """
        note = moe.check_routers(model, replay=cfg.moe.routing_replay != "none")
        if note:  # experts whose routing gspo cannot read: they train, without the MoE component
            if dist.is_main:
                print(note)
            return MoEStep()
        return _MoE(model, cfg, dist, old_pass) if moe.is_moe(model) else MoEStep()

    def sample_kwargs(self) -> dict:
        return {}

    @contextlib.contextmanager
    def old_pass(self, model: torch.nn.Module, rollout: Rollout, record: bool = True) -> Iterator[None]:
        yield

    @contextlib.contextmanager
    def minibatch(self, model: torch.nn.Module, rollout: Rollout, rows: torch.Tensor,
                  window: slice = slice(0, None), packing: Optional[Packing] = None) -> Iterator[_NoMinibatch]:
        """Around one update's forward and backward on `rollout`'s `rows`, at its (P+T) columns `window`
        (`Rollout.trimmed`: the minibatch without the columns that are padding in all its rows); `packing`: the
        forward packs those rows (`train.shared_prefix`), whose routing is replayed and recorded through it."""
        yield _NoMinibatch()

    def end_step(self, model: torch.nn.Module, rollout: Rollout, step: int) -> dict[str, float]:
        return {}


class _Minibatch(_NoMinibatch):
    def __init__(self, owner: "_MoE", rows: torch.Tensor, trace: moe.RoutingTrace, window: slice):
        self.owner, self.rows, self.trace, self.window = owner, rows, trace, window

    def router_shift(self, sub: Rollout) -> Optional[torch.Tensor]:
        """RSPO: the router-shift factor (B, T) at the positions that predict each completion token."""
        o = self.owner
        if not o.rspo:
            return None
        old_idx = o.old_idx[self.rows][:, self.window]
        shift, _ = moe.router_shift(o.old_lp[self.rows][:, self.window], self.trace.logprobs(len(self.rows)), old_idx,
                                    sub.attention_mask)
        return shift[:, sub.prompt_len - 1 : -1]

    def aux_loss(self, sub: Rollout) -> torch.Tensor | float:
        """coef x the load-balancing loss on this minibatch's tokens, exact under any number of ranks."""
        o = self.owner
        if o.aux_coef <= 0:
            return 0.0
        # each router's own distribution and its own pick (not the replayed one): it balances the live routing
        self._aux = moe.load_balancing_loss(self.trace.logits(), o.top_k, sub.attention_mask, o.dist.all_sum,
                                            self.trace.scorings, self.trace.live())
        self._aux = self._aux * o.dist.world  # DDP averages gradients over ranks: x world undoes it
        return o.aux_coef * self._aux

    def stats(self) -> dict[str, float]:
        o = self.owner
        # what the update pass routed, against the old policy: 0 under replay
        out = {"moe/update_mismatch": moe.routing_volatility(
            o.old_idx[self.rows][:, self.window], self.trace.indices(len(self.rows)),
            o.completion_positions(self.rows)[:, self.window])[0]}
        if hasattr(self, "_aux"):
            out["moe/aux_loss"] = float(self._aux.detach())  # the mean over ranks is the whole minibatch's loss
        return out


class _MoE(MoEStep):
    def __init__(self, model: torch.nn.Module, cfg, dist, old_pass: bool):
        self.dist, self.use_old_pass = dist, old_pass
        self.replay = cfg.moe.routing_replay
        self.rspo = get_loss(cfg.algo.loss).router_shift  # the loss reads the router-shift factor (RSPO)
        self.aux_coef = float(cfg.model.router_aux_loss_coef)
        self.stats_every = int(cfg.moe.stats_every)
        self.stats_rows_per_group = int(cfg.moe.stats_rows_per_group)
        self.group_size = int(cfg.rollout.group_size)
        # a sampler in another precision routes differently from the trainer: record its routing to measure that
        self.mismatched = separate(cfg)
        self._pass_stats: dict[str, float] = {}
        routers = moe.find_routers(model)
        self.top_k, self.num_experts = routers[0].top_k, routers[0].num_experts
        self.old_idx: Optional[torch.Tensor] = None  # (N, P+T, L, k) the old policy's routing
        self.old_lp: Optional[torch.Tensor] = None  # (N, P+T, L, E) its router log-probs
        self._rollout: Optional[Rollout] = None

    def sample_kwargs(self) -> dict:
        # R3 replays the sampling routing; without an old-policy pass it is also the old policy's routing
        return {"capture_routing": self.replay == "R3" or not self.use_old_pass or self.mismatched}

    def _begin(self, rollout: Rollout) -> None:
        """Take the rollout's routing as the old policy's, unless an old-policy pass records it."""
        if self._rollout is not rollout:
            self._rollout = rollout
            self.old_idx, self.old_lp = rollout.routing, rollout.router_logp

    def completion_positions(self, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """(B, P+T) mask of the positions whose routing produces the completion's log-probs: P-1 .. P+T-2."""
        ro = self._rollout
        cm = ro.completion_mask if rows is None else ro.completion_mask[rows]
        out = torch.zeros((cm.shape[0], ro.input_ids.shape[1]), dtype=cm.dtype, device=cm.device)
        out[:, ro.prompt_len - 1 : -1] = cm
        return out

    @contextlib.contextmanager
    def old_pass(self, model: torch.nn.Module, rollout: Rollout, record: bool = True) -> Iterator[None]:
        """Around the trainer's pass on the rollout: `record` takes its routing as the old policy's
        (R3 replaying the sampler's); otherwise (sampler log-probs) the pass is a live diagnostic."""
        self._begin(rollout)
        with contextlib.ExitStack() as stack:
            if record and self.replay == "R3":  # the old policy routed as the sampler did: ratio 1 at the old weights
                stack.enter_context(moe.replay_routing(model, rollout.routing))
            trace = stack.enter_context(moe.capture_routing(model, logprobs=True))
            yield
        n = len(rollout.texts)
        if record:
            self.old_idx, self.old_lp = trace.indices(n), trace.logprobs(n)
        if rollout.routing is not None:  # what the trainer's router would pick (live, whatever was replayed)
            self._pass_stats = {"rollout/routing_mismatch": routing_mismatch(
                rollout.routing, trace.live_indices(n), self.completion_positions())}

    @contextlib.contextmanager
    def minibatch(self, model: torch.nn.Module, rollout: Rollout, rows: torch.Tensor,
                  window: slice = slice(0, None), packing: Optional[Packing] = None) -> Iterator[_Minibatch]:
        self._begin(rollout)
        replay = {"R2": self.old_idx, "R3": rollout.routing}.get(self.replay)
        source, spread = (None, None) if packing is None else (packing.source, packing.spread)
        with contextlib.ExitStack() as stack:
            if replay is not None:  # open through backward: gradient checkpointing re-runs the forward there
                stack.enter_context(moe.replay_routing(model, replay[rows][:, window], source))
            # one recorded call: a checkpointed forward re-run inside backward is not recorded again
            trace = stack.enter_context(moe.capture_routing(model, logprobs=self.rspo, keep_logits=self.aux_coef > 0,
                                                            max_calls=1, spread=spread))
            yield _Minibatch(self, rows, trace, window)

    @torch.no_grad()
    def end_step(self, model: torch.nn.Module, rollout: Rollout, step: int) -> dict[str, float]:
        """Routing of the updated policy vs the old one on the same tokens (a subsample of rows).

        `moe/routing_volatility` counts the completion positions whose routing produced the
        log-probs (as the GSPO paper measures it); `moe/routing_volatility_all` adds the prompt.
        Runs every `moe.stats_every` steps, on `moe.stats_rows_per_group` rows of each group
        (rows of a group are exchangeable samples; 0 = every row).
        """
        self._begin(rollout)
        out, self._pass_stats = self._pass_stats, {}  # the sampler/trainer routing mismatch of this step's pass
        if not self.stats_every or step % self.stats_every:
            return out
        n, G, k = len(rollout.texts), self.group_size, self.stats_rows_per_group
        rows = torch.arange(n) if not k or k >= G else (torch.arange(0, n, G)[:, None] + torch.arange(k)).reshape(-1)
        sub = rollout.select(rows)
        was_training = model.training
        model.eval()
        with moe.capture_routing(model, logprobs=True) as trace:  # live routing: no replay here
            model(input_ids=sub.input_ids, attention_mask=sub.attention_mask,
                  position_ids=position_ids(sub.attention_mask), logits_to_keep=1, use_cache=False)
        model.train(was_training)
        new_idx, new_lp = trace.indices(len(rows)), trace.logprobs(len(rows))
        old_idx = self.old_idx[rows]
        out |= moe.moe_metrics(old_idx, new_idx, self.old_lp[rows], new_lp, self.completion_positions(rows), self.num_experts)
        out["moe/routing_volatility_all"] = moe.routing_volatility(old_idx, new_idx, sub.attention_mask)[0]
        return out
