import threading

from torch._inductor import cudagraph_trees as trees

from continuous.models.graphs import GraphTrees


def in_thread(fn):
    """``fn()`` on a new thread: its result, or the exception it raised."""
    out = []

    def run():
        try:
            out.append(fn())
        except AssertionError as exc:
            out.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return out[0]


def test_a_thread_that_shares_uses_the_graph_trees_of_the_thread_that_made_the_model():
    shared = GraphTrees()
    mine = trees.get_obj(trees.local, "tree_manager_containers")
    assert shared.state["tree_manager_containers"] is mine

    def look(share):
        if share:
            shared.share()
        return trees.get_obj(trees.local, "tree_manager_containers"), trees.get_obj(trees.local, "tree_manager_locks")

    containers, locks = in_thread(lambda: look(share=True))
    assert containers is mine and locks is shared.state["tree_manager_locks"]
    # Unshared, a new thread gets graph trees of its own (or, on torch 2.11, an error).
    alone = in_thread(lambda: look(share=False))
    assert isinstance(alone, AssertionError) or alone[0] is not mine


def test_sharing_twice_keeps_the_first_state():
    shared, other = GraphTrees(), GraphTrees()
    other.state = {key: {} for key in other.state}

    def twice():
        shared.share()
        other.share()
        return trees.get_obj(trees.local, "tree_manager_containers")

    assert in_thread(twice) is shared.state["tree_manager_containers"]
