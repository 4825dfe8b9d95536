"""DAPO batch shaping: soft overlong punishment and dynamic sampling."""

import warnings

import pytest
import torch

from gspo.algos.shaping import dynamic_sampling, informative_groups, overlong_penalty


def test_overlong_penalty_by_hand():
    # L_max = 10, L_cache = 4: free up to 6, linear to -1 at 10, -1 beyond
    lengths = torch.tensor([3, 6, 7, 8, 10, 11])
    assert overlong_penalty(lengths, 10, 4).tolist() == pytest.approx([0, 0, -0.25, -0.5, -1.0, -1.0])
    assert overlong_penalty(lengths, 10, 4, penalty=0.5).tolist() == pytest.approx([0, 0, -0.125, -0.25, -0.5, -0.5])
    assert overlong_penalty(lengths, 10, 0).tolist() == [0.0] * 6
    with pytest.raises(ValueError):
        overlong_penalty(lengths, 10, -1)


def test_overlong_penalty_stays_on_the_lengths_device():
    # the first GPU run: the penalty was built on the CPU beside CUDA lengths (RuntimeError); "meta" stands in
    for buffer in (0, 4):
        assert overlong_penalty(torch.tensor([3, 8, 11], device="meta"), 10, buffer).device.type == "meta"


def test_informative_groups():
    r = torch.tensor([1.0, 1, 0, 1, 0.1, 0.1, 0, 0])
    assert informative_groups(r, 2).tolist() == [False, True, False, False]
    assert informative_groups(r, 4).tolist() == [True, True]


class Source:
    """A rollout source: each draw is n groups of G rewards, scripted; the batch is a list of group ids."""

    def __init__(self, scripted, group_size):
        self.scripted, self.g, self.next_id, self.draws = list(scripted), group_size, 0, 0

    def draw(self):
        groups = self.scripted[self.draws % len(self.scripted)]
        self.draws += 1
        ids = list(range(self.next_id, self.next_id + len(groups)))
        self.next_id += len(groups)
        self.rewards = dict(zip(ids, groups))
        batch = [(i, self.rewards[i]) for i in ids]
        return batch, torch.tensor([x for grp in groups for x in grp], dtype=torch.float32)


def select(batch, idx):
    return [batch[i] for i in idx]


def cat(batches):
    return [g for b in batches for g in b]


def test_dynamic_sampling_fills_with_informative_groups_only():
    src = Source([[[1, 1], [0, 1], [0, 0]], [[1, 0], [1, 1], [0.1, 1]]], group_size=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # filled: no warning
        batch, st = dynamic_sampling(src.draw, select, cat, num_groups=3, group_size=2, max_batches=5)
    assert len(batch) == 3  # truncated to exactly num_groups: the 4th informative group is unused
    assert all(len(set(r)) > 1 for _, r in batch)  # never a group with equal rewards
    assert [gid for gid, _ in batch] == [1, 3, 5]
    assert st == {"sampling/batches": 2.0, "sampling/groups_drawn": 6.0,
                  "sampling/groups_dropped": 3.0, "sampling/groups_kept": 3.0}


def test_dynamic_sampling_stops_at_bound_with_warning():
    src = Source([[[1, 1], [0, 1], [0, 0]]], group_size=2)  # one informative group per draw
    with pytest.warns(UserWarning, match=r"kept 2 of 5 .* after 2 rollout batches.*max_sample_batches"):
        batch, st = dynamic_sampling(src.draw, select, cat, num_groups=5, group_size=2, max_batches=2)
    assert src.draws == 2 and st["sampling/batches"] == 2.0
    assert len(batch) == 2 and all(len(set(r)) > 1 for _, r in batch)


def test_dynamic_sampling_returns_last_draw_when_nothing_kept():
    src = Source([[[1, 1], [0, 0]]], group_size=2)
    with pytest.warns(UserWarning, match="kept 0 of 2"):
        batch, st = dynamic_sampling(src.draw, select, cat, num_groups=2, group_size=2, max_batches=3)
    assert [gid for gid, _ in batch] == [4, 5]  # the third draw, whole
    assert st["sampling/groups_kept"] == 0.0 and st["sampling/groups_dropped"] == 6.0


def test_dynamic_sampling_keeps_drawing_until_every_rank_is_full():
    """Under several ranks a full rank keeps drawing (keeping nothing) while another is short, so every rank
    draws the same number of batches and the collectives inside a draw pair up (FSDP hung at step 3 before)."""
    src = Source([[[0, 1], [1, 0]]], group_size=2)  # this rank is full after one draw
    other_done_after = 3  # the other rank needs three
    asked = []

    def agree(done):
        asked.append(done)
        return done and len(asked) > other_done_after

    batch, st = dynamic_sampling(src.draw, select, cat, num_groups=2, group_size=2, max_batches=5, agree=agree)
    assert src.draws == 3 and st["sampling/batches"] == 3.0
    assert [gid for gid, _ in batch] == [0, 1]  # what it kept from its first draw, nothing after
    assert asked == [False, True, True, True]
