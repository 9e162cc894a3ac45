"""The fused linear cross-entropy of Bragg's trainer, as a torch operator for your own loop.

    import bragg_train_lce
    bragg_train_lce.load()  # compiles against this torch once (about a minute), then cached
    logprobs, entropy = bragg_train_lce.linear_cross_entropy(hidden, lm_head_weight, labels)

hidden [T, H] and weight [V, H] (float32 or bfloat16, CPU), labels [T] int64 in [0, V). Returns
each label's log-probability under softmax(hidden @ weight.T / temperature) and that softmax's
entropy, both [T] float32, without ever holding the [T, V] logits: about
2 x token_chunk x (vocab_chunk or V) x 4 bytes extra. Differentiable with respect to hidden and
weight, from both outputs. Bad shapes or labels raise RuntimeError naming what is wrong.
deterministic=True gives the bits of the Bragg engine's sampler log-probs (token_chunk a multiple
of 32, vocab_chunk 0). The algorithm: src/train/kernels/README.md.
"""

import os

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
# src/train/kernels/python/bragg_train_lce -> src/
_SRC = os.path.normpath(os.path.join(_HERE, "..", "..", "..", ".."))
_ABSL_LIBS = ["absl_status", "absl_statusor", "absl_strings", "absl_str_format_internal",
              "absl_cord", "absl_strerror", "absl_raw_logging_internal"]


def load(build_directory=None, verbose=False):
    """Compiles (or reuses) the operator and registers torch.ops.bragg.linear_cross_entropy.

    build_directory: where the build goes (default: torch's extension cache). Needs a C++
    compiler and Abseil's headers and libraries (Debian's libabsl-dev), as the C++ build does.
    """
    if hasattr(torch.ops, "bragg") and hasattr(torch.ops.bragg, "linear_cross_entropy"):
        return
    from torch.utils import cpp_extension

    if build_directory is not None:
        os.makedirs(build_directory, exist_ok=True)
    cpp_extension.load(
        name="bragg_train_lce_op",
        sources=[os.path.join(_SRC, "train", "kernels", "python", "lce_op.cc"),
                 os.path.join(_SRC, "train", "kernels", "linear_cross_entropy.cc")],
        extra_include_paths=[_SRC],
        extra_cflags=["-O2", "-std=c++20"],
        extra_ldflags=["-l" + lib for lib in _ABSL_LIBS],
        build_directory=build_directory,
        is_python_module=False,
        verbose=verbose,
    )


def linear_cross_entropy(hidden, weight, labels, token_chunk=1024, vocab_chunk=0,
                         temperature=1.0, deterministic=False):
    """(logprobs, entropy), both [T] float32; see the module's docstring. Call load() first."""
    return torch.ops.bragg.linear_cross_entropy(hidden, weight, labels, token_chunk, vocab_chunk,
                                                float(temperature), deterministic)
