"""gspo's own construction (gspo/models/split_experts.py `split`, commit as printed) on the 10^5-token calibration
text (calib_big.pt): a shared expert + routed experts, top-k, then layer-wise recovery, resumable in --state.
Prints gspo's log lines and the record; the KL on the held-out eighth is gspo's `kl_to_dense`, and on calib_held
(the earlier explorations' held-out text) for comparison."""
import argparse, json, subprocess, time
import torch
from common import *
from gspo.config.schema import SplitExpertsConfig

p = argparse.ArgumentParser()
p.add_argument("--shared", type=int, default=192)
p.add_argument("--experts", type=int, default=42)
p.add_argument("--top_k", type=int, default=18)
p.add_argument("--epochs", type=int, default=3)
p.add_argument("--lr", type=float, default=1e-3)
p.add_argument("--train", default="calib_big")
p.add_argument("--out", required=True)
args = p.parse_args()
torch.set_num_threads(1)
print("gspo commit", subprocess.run(["git", "-C", "/work/main", "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True).stdout.strip(), flush=True)
model, tok = dense()
ids, mask = torch.load(HERE / f"{args.train}.pt")
settings = SplitExpertsConfig(experts=args.experts, top_k=args.top_k, shared=args.shared,
                              layerwise_epochs=args.epochs, layerwise_lr=args.lr)
t = time.time()
moe, record = se.split(model, ids, mask, settings, log=lambda m: print(m, flush=True), state_dir=HERE / f"{args.out}.partial")
hid, hmask = calib(model, tok, "calib_held", 16, 160, 1)
record["kl_calib_held"] = se.next_token_kl(se.batched_logps(model, hid, hmask), moe, hid, hmask)
record["build_seconds"] = round(time.time() - t)
print("KL on calib_held", record["kl_calib_held"], flush=True)
json.dump(record, open(HERE / f"{args.out}.json", "w"), indent=1)
moe.save_pretrained(HERE / f"{args.out}.model")
tok.save_pretrained(HERE / f"{args.out}.model")
