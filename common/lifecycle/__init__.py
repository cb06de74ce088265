"""A role process's life and what outlives it: the lifecycle wing of `common/`.

role_process.py      the lifecycle every target and drafter shares: row, ledger, readiness, teardown
startup.py           its start-up phases, timed and reported
liveness.py          lock files the kernel frees on any death: who is alive
membership.py        a row taken, or given up, with what a dead holder left sealed first
seat.py              a role index's seat, waited for while another process may hold it (the warm standby's)
sd_notify.py         systemd readiness and watchdog
rendezvous.py        the cross-host store replica groups meet through
ledger.py            the optional per-process record of what it published, took and trained
ledger_events.py     its typed records, with their one writer and parser
resume_state.py      a producer's resume point and replay list on disk
trained_journal.py   what a drafter trained since its checkpoint, produced again if it dies
checkpoint_choice.py which checkpoint a resume takes: the store's rule, and the journal's
diverged.py          a drafter's training gone bad: its one line and exit code, which nothing restarts
"""
