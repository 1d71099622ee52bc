# >>> ch04 file: the scheduler
