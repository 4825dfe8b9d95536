"""10^5 calibration tokens for the recovery: 5 chunks of 128 conversations x 160 tokens (seeds 2-6), the dense model
writing as split_moe.calibration_ids does; saved as calib_big.pt (ids, mask), padded to 160."""
import sys, time, torch
from common import *
torch.set_num_threads(1)
model, tok = dense()
from gspo.train.start.split_moe import calibration_ids
parts = []
for seed in range(2, 7):
    t = time.time()
    ids, mask = calibration_ids(model, tok, 128, 160, seed)
    pad = 160 - ids.shape[1]
    ids = torch.nn.functional.pad(ids, (0, pad), value=tok.pad_token_id or 0); mask = torch.nn.functional.pad(mask, (0, pad))
    parts.append((ids, mask))
    print(f"seed {seed}: {int(mask.sum())} tokens in {time.time()-t:.0f}s", flush=True)
ids = torch.cat([p[0] for p in parts]); mask = torch.cat([p[1] for p in parts])
torch.save((ids, mask), HERE / "calib_big.pt")
print("total", int(mask.sum()), flush=True)
