"""Pipeline parallelism (lesson 08): schedules as action lists, a send/recv executor, torch's pipelining, measurements."""
