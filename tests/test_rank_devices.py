"""Which device a data-parallel rank runs on (model.device): pure functions of the rank and the
GPUs it sees, so they are checked here without a GPU; an explicit GPU index with several
processes is refused before any process group or model."""

from __future__ import annotations

import pytest
import torch

from conftest import compose_config
from marl_llm.config import UserError
from marl_llm.distributed.data_parallel import World, cuda_index
from marl_llm.models.loading import resolve_device


@pytest.mark.parametrize("name", ["cuda", "auto"])
@pytest.mark.parametrize("world,gpus,want", [
    (World(rank=3, size=4, local_rank=3), 4, "cuda:3"),  # one node, 4 GPUs: the local rank's
    (World(rank=5, size=8, local_rank=1), 4, "cuda:1"),  # second node: the local, not the global, rank
    (World(rank=1, size=2, local_rank=1), 1, "cuda:0"),  # the launcher shows each task its own GPU
])
def test_each_rank_takes_its_local_gpu(name, world, gpus, want):
    assert resolve_device(name, world, cuda_count=gpus) == torch.device(want)


def test_one_process_keeps_the_device_it_names():
    one = World()
    assert resolve_device("cuda", one, cuda_count=4) == torch.device("cuda")  # the current GPU
    assert resolve_device("cuda:2", one, cuda_count=4) == torch.device("cuda:2")
    assert resolve_device("auto", one, cuda_count=0) == torch.device("cpu")
    assert resolve_device("cpu", World(rank=1, size=4, local_rank=1), cuda_count=4) == torch.device("cpu")


def test_an_explicit_gpu_index_with_several_ranks_is_refused():
    with pytest.raises(UserError, match=r"model.device=cuda:0 with 4 data-parallel processes puts every rank on "
                                        r"GPU 0: use model.device=cuda \(each rank takes its local GPU\)"):
        resolve_device("cuda:0", World(rank=2, size=4, local_rank=2), cuda_count=4)


def test_more_ranks_per_node_than_gpus_is_refused():
    assert [cuda_index(i, 4) for i in range(4)] == [0, 1, 2, 3]
    with pytest.raises(UserError, match=r"local rank 4 but this node shows 4 GPUs: start at most 4 processes"):
        cuda_index(4, 4)
    with pytest.raises(UserError, match="CUDA is not available"):
        resolve_device("cuda", World(rank=1, size=2, local_rank=1), cuda_count=0)


def test_the_config_refusal_comes_before_any_process_group(monkeypatch):
    from marl_llm.training.setup import join_world

    monkeypatch.setenv("WORLD_SIZE", "4")  # as torchrun --nproc_per_node 4 sets it
    with pytest.raises(UserError, match="model.device=cuda:1 with 4 data-parallel processes puts every rank on GPU 1"):
        join_world(compose_config(["model.device=cuda:1", "trainer.prompts_per_step=4"]))
    assert not torch.distributed.is_initialized()
