"""gloo's interface chosen toward the master (ds_trhash.network), in this process: on this host's
loopback, and on hosts of their own (network namespaces with a cable each to one switch), where
the master's host picks the interface holding the master address, another host the interface of
its route, and a host whose route is loopback or missing is refused naming what it tried."""
import pytest

from ds_trhash import network
from ds_trhash.errors import UserError
from tests.netns import hosts_or_skip, ip


@pytest.fixture(scope="module")
def hosts():
    """Two hosts on one switch; host 0 has a default route (through a gateway on its network),
    host 1 none, and a route into 198.19.255.0/24 over its loopback."""
    with hosts_or_skip(2) as made:
        ip("-n", made.namespaces[0], "route", "add", "default", "via", f"{made.prefix}.254")
        ip("-n", made.namespaces[1], "route", "add", "198.19.255.0/24", "dev", "lo")
        yield made


def test_the_master_on_loopback_is_reached_over_loopback():
    chosen = network.choose_gloo_interface("127.0.0.1")
    assert (chosen.name, chosen.address, chosen.reason) == ("lo", "127.0.0.1", "holds the master address")
    assert network.choose_gloo_interface("localhost").name == "lo"
    # a host name mapped to 127.0.1.1 (Debian's /etc/hosts): this host, over loopback, not refused
    assert network.choose_gloo_interface("127.0.1.1") == network.GlooInterface("lo", "127.0.0.1",
                                                                                "the master 127.0.1.1 is this host")


def test_the_masters_host_picks_the_interface_holding_the_master_address(hosts):
    chosen = hosts.inside(0, lambda: network.choose_gloo_interface(hosts.address(0)))
    assert chosen == network.GlooInterface(hosts.device(0), hosts.address(0), "holds the master address")


def test_another_host_picks_the_interface_of_its_route_to_the_master(hosts):
    chosen = hosts.inside(1, lambda: network.choose_gloo_interface(hosts.address(0)))
    assert chosen == network.GlooInterface(hosts.device(1), hosts.address(1), f"the route to the master {hosts.address(0)}")
    assert chosen.describe() == f"gloo over {hosts.device(1)} ({hosts.address(1)}: the route to the master {hosts.address(0)})"


def test_setting_gloo_socket_ifname_is_left_as_set_and_a_choice_is_written_once(hosts):
    env = {"MASTER_ADDR": hosts.address(0)}
    chosen = hosts.inside(1, lambda: network.use_gloo_interface(env))
    assert env["GLOO_SOCKET_IFNAME"] == hosts.device(1) == chosen.name
    assert network.gloo_interface_in_use() == chosen
    assert hosts.inside(1, lambda: network.use_gloo_interface(env)) == chosen  # a second start: the same choice
    assert network.describe_network(gpu=True).endswith("; NCCL's own choice (NCCL_SOCKET_IFNAME overrides)")
    mine = {"MASTER_ADDR": hosts.address(0), "GLOO_SOCKET_IFNAME": "lo"}
    kept = hosts.inside(1, lambda: network.use_gloo_interface(mine))
    assert mine["GLOO_SOCKET_IFNAME"] == "lo" and kept.describe() == "gloo over lo (set by GLOO_SOCKET_IFNAME)"


def test_a_gloo_socket_ifname_naming_no_interface_here_is_refused(hosts):
    env = {"MASTER_ADDR": hosts.address(0), "GLOO_SOCKET_IFNAME": "eth9"}
    with pytest.raises(network.NetworkError) as refused:
        hosts.inside(1, lambda: network.use_gloo_interface(env))
    assert str(refused.value) == (
        f"GLOO_SOCKET_IFNAME=eth9 names eth9, which this host does not have (its interfaces: {hosts.device(1)}, lo); "
        "set it to the interface that reaches the master, or unset it and the launch chooses that one")
    assert env == {"MASTER_ADDR": hosts.address(0), "GLOO_SOCKET_IFNAME": "eth9"}


def test_a_master_no_route_reaches_is_refused_naming_what_was_tried(hosts):
    env = {"MASTER_ADDR": "198.19.254.1"}
    with pytest.raises(network.NetworkError) as refused:
        hosts.inside(1, lambda: network.use_gloo_interface(env))
    assert isinstance(refused.value, UserError) and refused.value.exit_code == 2 and refused.value.per_rank
    assert str(refused.value) == (
        "no network interface of this host reaches the master MASTER_ADDR=198.19.254.1: tried 198.19.254.1: no route "
        f"(Network is unreachable) (interfaces here: {hosts.device(1)}, lo); check the route to it "
        "(`ip route get 198.19.254.1`) and the master address (deepspeed --master_addr), or set GLOO_SOCKET_IFNAME "
        "to the interface that reaches it")
    assert "GLOO_SOCKET_IFNAME" not in env  # nothing set on a refusal


def test_a_route_to_another_host_through_loopback_is_refused(hosts):
    with pytest.raises(network.NetworkError) as refused:
        hosts.inside(1, lambda: network.choose_gloo_interface("198.19.255.7"))
    assert ("tried 198.19.255.7: the route leaves through the loopback interface lo, which never reaches another host"
            in str(refused.value))


def test_a_master_name_that_does_not_resolve_is_refused():
    with pytest.raises(network.NetworkError) as refused:
        network.choose_gloo_interface("no-such-host.invalid")
    assert str(refused.value).startswith("MASTER_ADDR=no-such-host.invalid does not resolve on this host (")
    assert str(refused.value).endswith("pass the master node's IP address (deepspeed --master_addr) "
                                       "or a name every node resolves")


def test_the_route_source_is_the_kernels_answer(hosts):
    assert network.route_source("127.0.0.1") == "127.0.0.1"
    assert hosts.inside(0, lambda: network.route_source(hosts.address(1))) == hosts.address(0)
    assert hosts.inside(0, lambda: network.route_source("198.19.254.1")) == hosts.address(0)  # the default route
    with pytest.raises(OSError):
        hosts.inside(1, lambda: network.route_source("198.19.254.1"))


def test_a_master_name_mapped_to_loopback_on_its_own_node_means_the_default_routes_interface(hosts, monkeypatch):
    """/etc/hosts maps the master node's own name to 127.0.1.1: in a job of several nodes its peers
    cannot reach that, so the master's node takes the interface of its default route; alone, loopback."""
    monkeypatch.setattr(network, "resolve_master", lambda master: ["127.0.1.1"])  # the node's /etc/hosts
    several = hosts.inside(0, lambda: network.choose_gloo_interface("node-a", several_nodes=True))
    alone = hosts.inside(0, lambda: network.choose_gloo_interface("node-a", several_nodes=False))
    assert (several.name, several.address, alone.name) == (hosts.device(0), hosts.address(0), "lo")
    assert network.loopback_name("node-a", ["127.0.1.1"])
    assert not network.loopback_name("localhost", ["127.0.0.1"]) and not network.loopback_name("127.0.0.1", ["127.0.0.1"])
    assert not network.loopback_name("node-a", ["127.0.1.1", hosts.address(0)])
    chosen = hosts.inside(0, lambda: network.outward_interface("node-a", ["127.0.1.1"], network.local_addresses()))
    assert chosen == network.GlooInterface(hosts.device(0), hosts.address(0),
                                           "the default route's: the master name node-a is this host's loopback "
                                           "127.0.1.1 here")
    with pytest.raises(network.NetworkError) as refused:
        hosts.inside(1, lambda: network.outward_interface("node-a", ["127.0.1.1"], network.local_addresses()))
    assert str(refused.value) == (
        "MASTER_ADDR=node-a resolves to the loopback address 127.0.1.1 on this node, which the other nodes cannot "
        "reach, and no default route names another interface; pass this node's address on the nodes' network as the "
        "master address (deepspeed --master_addr), map node-a to it in /etc/hosts, or set GLOO_SOCKET_IFNAME to the "
        "interface the other nodes reach")
