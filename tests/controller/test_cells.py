"""The cell registry's routes: every answering server of every serving cell."""

from controller.cells import CellRegistry

URLS = ["http://10.0.0.1:30000", "http://10.0.0.1:30001", "http://10.0.0.2:30000"]


def serving_registry() -> CellRegistry:
    cells = CellRegistry(2, core_cell=0)
    for cell, urls in ((cells.cells[0], ["http://10.0.0.9:30000"]), (cells.cells[1], URLS)):
        cell.engine_url, cell.engine_urls, cell.weight_version = urls[0], urls, 3
        cell.set_phase("serving", 1.0)
    return cells


def test_a_server_that_stopped_answering_leaves_the_routes_until_it_answers_again():
    cells = serving_registry()
    cell = cells.cells[1]
    assert [u for _, u, _ in cells.routes()] == ["http://10.0.0.9:30000", *URLS]
    assert cell.set_down([URLS[1], "http://10.0.0.9:30000"]) == ([URLS[1]], [])  # another cell's URL: ignored
    assert [u for _, u, _ in cells.routes()] == ["http://10.0.0.9:30000", URLS[0], URLS[2]]
    assert cell.set_down([URLS[1]]) == ([], [])  # no change, nothing to push
    assert cell.set_down([URLS[0], URLS[1], URLS[2]]) == ([URLS[0], URLS[2]], [])
    assert [c for c, _, _ in cells.routes()] == [0]  # the cell serves through nothing now
    assert cell.set_down([]) == ([], URLS)
    assert [u for _, u, _ in cells.routes()] == ["http://10.0.0.9:30000", *URLS]


def test_a_cell_that_is_not_serving_routes_nothing_whatever_its_servers_say():
    cells = serving_registry()
    cells.cells[1].set_phase("draining", 2.0)
    cells.cells[1].set_down([])
    assert [c for c, _, _ in cells.routes()] == [0]
