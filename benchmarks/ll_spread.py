"""How far plain decoding's mean log-likelihood moves between seed sets (T = 1).

``engine.py`` compares each speculative row's T = 1 texts with ONE plain realization (seeds
1000 + prompt index). This runs plain decoding (HF ``generate`` on the packed fp32 target) on
the same prompts with other seed sets and scores the texts under the stock fp32 target the same
way, so a speculative row's difference can be read against the spread of the plain law itself.

    python benchmarks/ll_spread.py --seed-base 2000 --out benchmarks/results/ll_spread_2000

Writes ``<out>.{json,md}``.
"""

from __future__ import annotations

import argparse
import statistics

import torch

import treespec
from harness import RESULTS, hf_generate, log_likelihood, machine_info, write_results
from treespec.data import chat_prompt, mtbench_questions


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed-base", type=int, required=True, help="prompt i is sampled with seed base + i")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    stock = treespec.load_target("smollm2-135m", dtype=torch.float32, pack=False)
    packed = treespec.load_target("smollm2-135m", dtype=torch.float32, pack=True)
    eos = list(stock.eos_token_ids)
    per_prompt = []
    for qi, q in enumerate(mtbench_questions()[: args.prompts]):
        ids = torch.tensor(chat_prompt(stock.tokenizer, q.turns[0]))
        new, _ = hf_generate(packed.model, ids, args.max_new_tokens, eos, 1.0, args.seed_base + qi)
        ll, n = log_likelihood(stock.model, ids, new.cpu())
        per_prompt.append(ll / n)
    mean = statistics.mean(per_prompt)
    result = {"machine": machine_info(), "args": vars(args), "mean_ll": mean, "per_prompt_ll": per_prompt}
    md = (f"# Plain decoding's T = 1 log-likelihood, seeds {args.seed_base} + prompt index\n\n"
          f"CPU: {result['machine']['cpu_model']}; flags: {', '.join(result['machine']['cpu_flags'])}; "
          f"{result['machine']['torch_threads']} thread(s). "
          f"{args.prompts} MT-bench prompts x {args.max_new_tokens} tokens, HF `generate` on the packed fp32 "
          f"target ({packed.speed_path.split('linear layers: ')[1].split(':')[0]}), scored under the stock fp32 "
          f"target.\n\nMean log-likelihood per token over prompts: **{mean:.3f}**\n")
    print(md)
    write_results(args.out or RESULTS / f"ll_spread_{args.seed_base}", result, md)


if __name__ == "__main__":
    main()
