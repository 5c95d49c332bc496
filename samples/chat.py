"""Streaming terminal chat on the embedded model, the KV cache kept across turns.

    python samples/chat.py                      # backend openvino, full cache
    python samples/chat.py --kv-precision f32
    python samples/chat.py --backend torch --method kvcrush --budget 256

The app is :mod:`ov_kvcrush.cli.chat`; this script runs it as ``ov-kvcrush chat`` does. At its
core, with the public API::

    pipe = ov_kvcrush.LLMPipeline(None, "CPU", backend="openvino")
    pipe.start_chat("You are a helpful assistant.")
    for line in sys.stdin:
        pipe.generate(line, max_new_tokens=256, streamer=lambda s: print(s, end="", flush=True))
    pipe.finish_chat()
"""

import sys

from ov_kvcrush.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["chat", *sys.argv[1:]]))
