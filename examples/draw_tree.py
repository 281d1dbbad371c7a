"""Draw a real SmolLM2 draft tree: decoded tokens on the nodes, the accepted path in green.

    python examples/draw_tree.py --out tree.png
    python examples/draw_tree.py --tree best-first --budget 32 --drafter eagle --temperature 1

Generates a short answer with speculative decoding and draws the step that accepted the most
tokens (``treespec generate --show-tree DIR`` saves every step instead).
"""

from __future__ import annotations

import argparse

from treespec import SpeculativeGenerator, load_drafter, load_target, registered_drafters
from treespec.cli.main import BUILDERS, make_builder
from treespec.cli.viz import draw_tree


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", default="Write a haiku about the sea.")
    parser.add_argument("--drafter", default="early-exit", choices=registered_drafters())
    parser.add_argument("--tree", default="dynamic", choices=BUILDERS)
    parser.add_argument("--budget", type=int, default=16)
    parser.add_argument("--depth", type=int, default=5)
    parser.add_argument("--top-k-draft", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--out", default="tree.png")
    args = parser.parse_args()

    target = load_target("smollm2-135m")
    builder = make_builder(args.tree, args.budget, args.depth, args.top_k_draft)
    gen = SpeculativeGenerator(target, load_drafter(args.drafter, target), builder)
    steps = []  # (accepted tokens, step, built tree, acceptance)
    result = gen.generate(args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                          seed=0, on_step=lambda built, acc, step: steps.append(
                              (acc.num_accepted, -step, built, acc)))
    accepted, step, built, acc = max(steps, key=lambda s: s[:2])
    print(result.text)
    print(f"\n{len(steps)} steps, tau = {result.stats.tau:.2f}; drawing step {-step} "
          f"({accepted} accepted of {built.tree.num_nodes - 1} drafted)")
    path = draw_tree(built, acc, target.tokenizer, path=args.out,
                     title=f"{type(builder).__name__} + {args.drafter}, step {-step}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
