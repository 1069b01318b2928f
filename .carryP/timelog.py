import os, time, json
_T = {}
_OUT = os.environ.get("TIMELOG", "/work/notes/ci/timelog.jsonl")
def pytest_runtest_logstart(nodeid, location):
    _T[nodeid] = (time.perf_counter(), time.process_time())
def pytest_runtest_logfinish(nodeid, location):
    w0, c0 = _T.pop(nodeid, (time.perf_counter(), time.process_time()))
    with open(_OUT, "a") as f:
        f.write(json.dumps({"id": nodeid, "wall": time.perf_counter() - w0, "cpu": time.process_time() - c0}) + "\n")
