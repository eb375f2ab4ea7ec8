"""llama.cpp's side of bench/llamacpp.py, run by .venv-llama's Python (llama-cpp-python; no torch here).

`python -m bench.llamacpp_worker GGUF N_CTX THREADS` loads the GGUF file, then answers JSON commands on stdin
with JSON lines on stdout: {"prefill": ids} -> seconds to evaluate them into an empty context;
{"decode": token, "steps": k} -> seconds for each of k single-token evaluations after the last prefill.
The token ids come from the caller (the same text, tokenized here by `{"tokenize": text}`)."""
from __future__ import annotations

import json
import os
import sys
import time


def main() -> int:
    gguf, n_ctx, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # llama.cpp's own prints go to stderr, never into the protocol
    from llama_cpp import Llama, __version__

    llm = Llama(model_path=gguf, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, n_batch=512,
                n_ubatch=512, verbose=False)
    out.write(json.dumps({"ready": True, "version": __version__}) + "\n")
    for line in sys.stdin:
        cmd = json.loads(line)
        if "tokenize" in cmd:
            out.write(json.dumps(llm.tokenize(cmd["tokenize"].encode("utf-8"), add_bos=False)) + "\n")
        elif "prefill" in cmd:
            llm.reset()  # an empty context: the next eval starts at position 0
            t = time.perf_counter()
            llm.eval(cmd["prefill"])
            out.write(json.dumps(time.perf_counter() - t) + "\n")
        elif "decode" in cmd:
            start, seconds = llm.n_tokens, []
            for _ in range(cmd["steps"]):
                t = time.perf_counter()
                llm.eval([cmd["decode"]])
                seconds.append(time.perf_counter() - t)
            llm.n_tokens = start  # back to the prefilled context: every measurement decodes at the same length
            out.write(json.dumps(seconds) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
