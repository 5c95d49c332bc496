"""Ask the embedded model for a passkey hidden in a long prompt, full cache vs native KVCrush.

python samples/passkey_native.py --tokens 1500 --budget 256
"""

from __future__ import annotations

import argparse

from ov_kvcrush import CompressionConfig, GenerationSettings
from ov_kvcrush.engines.genai import GenAIEngine
from ov_kvcrush.eval.tasks import passkey_prompt
from ov_kvcrush.models.export import ensure_default_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=1500)
    ap.add_argument("--budget", type=int, default=256)
    args = ap.parse_args()
    model = ensure_default_model()
    for cfg in (CompressionConfig(), CompressionConfig(method="kvcrush", budget=args.budget)):
        engine = GenAIEngine(model, cfg)
        sample = passkey_prompt(args.tokens, lambda t, e=engine: len(e.encode(t)), seed=1)
        r = engine.generate(sample.prompt, GenerationSettings(max_new_tokens=24))
        print(f"{cfg.method:8s} key={sample.answer} -> {r.text.strip()!r}  KV {r.kv_bytes} / {r.full_kv_bytes} bytes")


if __name__ == "__main__":
    main()
