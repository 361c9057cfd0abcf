# stop 20, third machine, call 3: the LoopServe GPU server tests (eager + graph replay)
GPU_TEST_TIMEOUT=540 GPU_TEST_TAG=_loopserve GPU_TEST_ARGS="tests/test_gpu_loopserve_server.py" bash scripts/gpu_session.sh gpu_tests
