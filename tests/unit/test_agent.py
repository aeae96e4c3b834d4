"""The launcher's patches of torch's elastic agent (`plait.train.agent`) change nothing
torch reports: the rendezvous's log records name the same methods as torch's own
`inspect.stack()` lookup, and the patch is gone after the launch."""

from __future__ import annotations

from torch.distributed.elastic.rendezvous import dynamic_rendezvous

from plait.train.agent import cheap_rendezvous_names


def _caller_of_caller(depth: int) -> str:
    return str(dynamic_rendezvous.get_method_name(depth))


def _named_by_a_method(depth: int) -> str:
    return _caller_of_caller(depth)


def test_the_rendezvous_names_the_same_methods_and_is_restored() -> None:
    torch_own = dynamic_rendezvous.get_method_name
    expected = [_named_by_a_method(d) for d in (1, 2, 3)]
    assert expected[:2] == ["_caller_of_caller", "_named_by_a_method"]  # torch's, unpatched
    with cheap_rendezvous_names():
        assert dynamic_rendezvous.get_method_name is not torch_own
        assert [_named_by_a_method(d) for d in (1, 2, 3)] == expected
        assert dynamic_rendezvous.get_method_name(10_000) == "no_method_name"
    assert dynamic_rendezvous.get_method_name is torch_own
