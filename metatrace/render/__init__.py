"""Terminal rendering (rich): the run report (run.py), communication (comm.py), diff and plan."""
