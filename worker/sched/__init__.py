"""The scheduler and its decisions, plain Python: requests and slots, the waiting queue,
admission, preemption, the batch's shape and plan, tick cost, speculation, and the records a
tick leaves."""
