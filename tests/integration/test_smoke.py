from tests.support.cluster import Cluster, create_running


def test_workspace_reaches_running(cluster: Cluster) -> None:
    client = cluster.new_user()
    workspace_id = create_running(client)
    assert client.get(f"/v1/workspaces/{workspace_id}").json()["host_id"].startswith("host_")
