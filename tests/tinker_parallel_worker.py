"""torchrun worker (not collected by pytest): the Tinker-compatible server under each layout of
tests/test_tinker_parallel.py in one launch, each driven through the SDK by rank 0.

    torchrun --standalone --nproc-per-node 2 tests/tinker_parallel_worker.py OUT_DIR DENSE_DIR MOE_DIR

For each layout the ranks run archon.serve's own start-up (`archon.serve.__main__.run` on the
command line tyro parses); rank 0 serves HTTP in a thread and drives it with `drive`, the other rank
follows rank 0's broadcast calls, and rank 0 writes what the SDK returned to OUT_DIR/<layout>.pkl.
"""

from __future__ import annotations

import pickle
import sys
import threading
from pathlib import Path

import pytest
from safetensors.torch import load_file
from test_tinker_fixtures import API_KEY, sft_datum, tinker, types  # the script's folder, tests/, is on sys.path
from worker_exit import exit_when_every_rank_is_done

from archon.rl.tasks import build_char_tokenizer
from archon.serve.__main__ import parse, run
from archon.serve.adapters import checkpoint_dir
from archon.serve.config import ServeConfig
from archon.serve.server import TinkerHTTPServer

LAYOUTS = {"fsdp2": ("dense", []), "tp2": ("dense", ["--parallel.tp", "2"]), "ep2": ("moe", ["--parallel.ep", "2"])}
"""Each layout: (its base, its flags beyond those every server gets)."""


def serve_args(base: Path, checkpoints: Path) -> list[str]:
    return [
        "--base-model",
        str(base),
        "--port",
        "0",
        "--api-key",
        API_KEY,
        "--max-lora-rank",
        "8",
        "--dtype",
        "float64",
        "--checkpoint-dir",
        str(checkpoints),
    ]


def drive(url: str, base: Path, tokenizer, checkpoints: Path) -> dict:
    """Two forward_backward + optim_step rounds, a forward, the adapter as saved, and seeded samples
    with their compute_logprobs, through the SDK."""
    service = tinker.ServiceClient(base_url=url, api_key=API_KEY)
    client = service.create_lora_training_client(base_model=str(base), rank=4, seed=3).result()
    data = [sft_datum(tokenizer, "12+34=46", prompt_chars=6), sft_datum(tokenizer, "7+8=15", prompt_chars=4)]
    out: dict = {"loss": [], "grad_norm": [], "logprobs": []}
    # a refused request is refused on every rank alike, and every rank goes on serving in step
    bad = types.Datum(model_input=types.ModelInput.from_ints([10**6]), loss_fn_inputs={"target_tokens": [1]})
    with pytest.raises(tinker.RequestFailedError, match="outside the vocabulary"):
        client.forward_backward([bad], "cross_entropy").result()
    for _ in range(2):
        fb = client.forward_backward(data, "cross_entropy")
        step = client.optim_step(types.AdamParams(learning_rate=2e-2, grad_clip_norm=1.0)).result()
        fb = fb.result()
        out["loss"].append(fb.metrics["loss:sum"])
        out["grad_norm"].append(step.metrics["grad_norm:mean"])
        out["logprobs"].append([o["logprobs"].to_numpy() for o in fb.loss_fn_outputs])
    after = client.forward(data, "cross_entropy").result()
    out["loss"].append(after.metrics["loss:sum"])
    out["logprobs"].append([o["logprobs"].to_numpy() for o in after.loss_fn_outputs])
    path = client.save_weights_for_sampler("parity").result().path
    out["adapter"] = load_file(checkpoint_dir(checkpoints, path) / "adapter" / "adapter_model.safetensors")
    prompt = tokenizer.encode("12+")
    for name, sampler in (("snapshot", client.create_sampling_client(path).result()), ("live", None)):
        if sampler is None:  # the training client's adapter as it is now, not through a checkpoint
            sampler = client.save_weights_and_get_sampling_client().result()
        response = sampler.sample(types.ModelInput.from_ints(prompt), 2, types.SamplingParams(max_tokens=6, seed=7))
        out[f"samples_{name}"] = [(s.tokens, s.logprobs) for s in response.result().sequences]
    tokens = prompt + out["samples_snapshot"][0][0]
    out["compute_logprobs"] = sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result()[1:]
    service.close("success").result()
    return out


def layout_of(backend) -> dict:
    """The degrees the server ran with, and how its base holds an attention and an expert weight."""
    dims = backend.dims
    params = dict(backend.base.model.named_parameters())
    placements = {}
    for name in ("layers.0.self_attn.q_proj.weight", "layers.1.mlp.experts.down_proj"):
        if name in params:
            param = params[name]
            placements[name] = dict(zip(param.device_mesh.mesh_dim_names, map(str, param.placements)))
    return {"tp": dims.tp, "ep": dims.ep, "dp_shard": dims.dp_shard, "placements": placements}


def _drive_on_rank0(base: Path, checkpoints: Path, out_file: Path):
    def serve_on_rank0(config: ServeConfig, backend) -> None:
        server = TinkerHTTPServer(config, backend)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            out = drive(server.url, base, build_char_tokenizer(), checkpoints)
            service = tinker.ServiceClient(base_url=server.url, api_key=API_KEY)
            client = service.create_lora_training_client(base_model=str(base), rank=4).result()
            with pytest.raises(tinker.RequestFailedError, match="not served under torchrun"):
                client.save_state("with-optimizer").result()
        finally:
            server.shutdown()
            server.server_close()
        out["layout"] = layout_of(backend)
        out_file.write_bytes(pickle.dumps(out))

    return serve_on_rank0


def main() -> None:
    out_dir, bases = Path(sys.argv[1]), {"dense": Path(sys.argv[2]), "moe": Path(sys.argv[3])}
    for layout, (base, flags) in LAYOUTS.items():
        checkpoints = out_dir / f"checkpoints_{layout}"
        config = parse([*serve_args(bases[base], checkpoints), *flags])
        run(config, _drive_on_rank0(bases[base], checkpoints, out_dir / f"{layout}.pkl"))
        print(f"tinker_parallel_worker: {layout} done", flush=True)
    exit_when_every_rank_is_done()


if __name__ == "__main__":
    main()
