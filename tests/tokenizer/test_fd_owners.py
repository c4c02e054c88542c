"""FdOwners: which client left when a connection descriptor closes, with descriptors reused."""

from __future__ import annotations

from himamba.services.tokenizer.client_socket import FdOwners


def test_a_disconnect_names_the_descriptors_owner_once() -> None:
    owners = FdOwners()
    assert owners.message(5, b"a") is None
    assert owners.message(5, b"a") is None  # more messages from the same client
    assert owners.disconnected(5) == b"a"
    assert owners.disconnected(5) is None  # nothing left on it
    assert owners.disconnected(9) is None  # a connection that never sent anything


def test_a_reused_descriptor_never_charges_the_old_disconnect_to_the_new_client() -> None:
    # Client a closes; the kernel gives its descriptor to client b, whose message is read
    # before a's DISCONNECTED: a is gone at once, and that late event is not b's.
    owners = FdOwners()
    owners.message(5, b"a")
    assert owners.message(5, b"b") == b"a"
    assert owners.disconnected(5) is None  # a's, owed
    assert owners.disconnected(5) == b"b"  # b's own


def test_reuse_after_the_old_disconnect_was_seen() -> None:
    owners = FdOwners()
    owners.message(5, b"a")
    assert owners.disconnected(5) == b"a"
    assert owners.message(5, b"b") is None
    assert owners.disconnected(5) == b"b"


def test_an_unreachable_client_is_forgotten_and_its_disconnect_is_owed() -> None:
    owners = FdOwners()
    owners.message(5, b"a")
    owners.message(6, b"c")
    owners.forget(b"a")  # a send found a unreachable: the caller ends its requests
    assert owners.message(5, b"b") is None  # b took a's descriptor
    assert owners.disconnected(5) is None  # a's DISCONNECTED, arriving late
    assert owners.disconnected(5) == b"b"
    assert owners.disconnected(6) == b"c"
