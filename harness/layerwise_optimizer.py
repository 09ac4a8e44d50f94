"""The layer-wise Muon optimizer (``--optimizer dist_muon``, legacy path) on every base.

One builder for the workers that run on both megatron-core bases: 0.17.1 has
``megatron.core.optimizer.muon.get_megatron_muon_optimizer(...,
layer_wise_distributed_optimizer=True)``; from 0.18 on ``OptimizerConfig`` carries
``use_layer_wise_distributed_optimizer`` (``muon.py`` is a shim) and
``get_megatron_optimizer`` builds it, as ``megatron.training`` does for ``dist_muon`` with
``--no-use-layer-wise-param-layout``.
"""

from __future__ import annotations


def layerwise_muon_optimizer(config, model_chunks, **kwargs):
    """The tree's LayerWiseDistributedOptimizer over ``model_chunks``.

    Args:
        config: the tree's ``OptimizerConfig`` (``optimizer="muon"``); on 0.18 and later its
            ``use_layer_wise_distributed_optimizer`` is set to True here.
        model_chunks: the (DDP-wrapped) model chunks.
        kwargs: passed to the tree's builder (e.g. ``use_gloo_process_groups=False``).
    """
    if hasattr(config, "use_layer_wise_distributed_optimizer"):
        from megatron.core.optimizer import get_megatron_optimizer

        config.use_layer_wise_distributed_optimizer = True
        return get_megatron_optimizer(config, model_chunks, **kwargs)
    from megatron.core.optimizer.muon import get_megatron_muon_optimizer

    return get_megatron_muon_optimizer(config, model_chunks, layer_wise_distributed_optimizer=True, **kwargs)
