"""LoRA's training curve against peft's and full fine-tuning's, in one process on the same packed batches.

Each variant starts from the same pretrained folder and trains on the same first ``--steps`` batches of the
reverse-words sample (packed rows of 128 tokens), AdamW without weight decay, gradients clipped at 1.0; the training
loss is printed every 20 steps. Variants: ``lora`` (lit_fsdp.lora, r 16, alpha 32, its default targets), ``peft``
(peft.get_peft_model with the same settings and targets), ``full`` (every weight), ``lora+norms`` and
``lora+norms+embeddings`` (those base modules trained beside the adapters: ``LoraConfig.train``, as
``--model.lora '{train: [norms, embeddings]}'``).

    python scripts/compare_lora.py --base runs/sft_base
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lit_fsdp from this checkout

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from lit_fsdp import lora  # noqa: E402
from lit_fsdp.data.sft import SFTDataModule  # noqa: E402
from lit_fsdp.loss import IGNORE_INDEX  # noqa: E402

SAMPLES = Path(__file__).resolve().parents[1] / "lit_fsdp" / "data" / "samples" / "reverse_words"
#: variant -> (learning rate, LoraConfig.train: the base modules trained beside the adapters; None: no adapters, every
#: weight)
VARIANTS = {
    "lora": (2e-3, []),
    "peft": (2e-3, []),
    "full": (3e-4, None),
    "lora+norms": (2e-3, ["norms"]),
    "lora+norms+embeddings": (2e-3, ["norms", "embeddings"]),
}


def model_for(variant: str, base: Path) -> torch.nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(base)
    if variant == "peft":
        import peft

        targets = lora.DEFAULT_TARGETS[model.config.model_type]
        return peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, target_modules=targets,
                                                          fan_in_fan_out=model.config.model_type == "gpt2"))
    trained = VARIANTS[variant][1]
    if trained is not None:
        lora.attach(model, lora.LoraConfig(rank=16, alpha=32, train=trained or None))
        lora.init_adapters(model, 0)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, required=True, help="the pretrained Hugging Face folder (with its tokenizer)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    args = parser.parse_args()
    data = SFTDataModule(str(SAMPLES / "train.jsonl"), str(SAMPLES / "val.jsonl"), tokenizer_path=str(args.base),
                         seq_len=128, batch_size=16, packing=True)
    data.setup("fit")
    loader = iter(data.train_dataloader())
    batches = [next(loader) for _ in range(args.steps)]
    print("| variant | lr | " + " | ".join(f"loss at step {s}" for s in range(20, args.steps + 1, 20)) + " |")
    print("|---|---|" + "---|" * len(range(20, args.steps + 1, 20)))
    for variant in args.variants:
        model = model_for(variant, args.base)
        params = [p for p in model.parameters() if p.requires_grad]
        learning_rate = VARIANTS[variant][0]
        optimizer = torch.optim.AdamW(params, lr=learning_rate, weight_decay=0.0)
        losses = []
        for step, batch in enumerate(batches, 1):
            logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE_INDEX)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            optimizer.zero_grad()
            if step % 20 == 0:
                losses.append(f"{loss.item():.2f}")
        print(f"| {variant} | {learning_rate:g} | " + " | ".join(losses) + " |", flush=True)


if __name__ == "__main__":
    main()
