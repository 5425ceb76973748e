"""``python -m precond_linattn.models``: every preset × preconditioner with its parameter count
and resident decode-state bytes (batch 1; nothing is allocated: ``jax.eval_shape``)."""

from precond_linattn.layers.config import PRECONDITIONERS
from precond_linattn.models.counting import count_params, decode_state_bytes
from precond_linattn.models.presets import NOMINAL_PARAMS, PRESETS, preset


def main():
    print("Decode state per sequence: memory S and preconditioner state in float32, short-conv "
          "tails in bf16.\n")
    header = (f"{'preset':15s} {'variant':10s} {'params':>9s} {'vs name':>8s} {'state/layer':>12s} "
              f"{'state/model':>12s} {'precond/S':>9s}")
    print(header)
    print("-" * len(header))
    for name in PRESETS:
        for pre in PRECONDITIONERS:
            config = preset(name, pre)
            n, s = count_params(config), decode_state_bytes(config)
            print(f"{name:15s} {config.layer.variant:10s} {n / 1e6:8.1f}M "
                  f"{n / NOMINAL_PARAMS[name] - 1:+8.1%} {s.per_layer / 2**10:9.1f}KiB "
                  f"{s.total / 2**20:9.3f}MiB {s.preconditioner / s.memory:9.2%}")


if __name__ == "__main__":
    main()
