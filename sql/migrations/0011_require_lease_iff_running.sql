-- A run holds a lease exactly while it is running. Every statement that takes a run out of
-- `running` already clears its lease owner; this makes it a rule the database enforces, so
-- the attempt fence's lease-owner check implies the state check (a write carrying a lease
-- owner can only match a running run).

UPDATE wq_runs SET lease_owner = NULL, lease_expires_at = NULL
 WHERE state <> 'running' AND lease_owner IS NOT NULL;

ALTER TABLE wq_runs DROP CONSTRAINT wq_runs_lease_while_running;
ALTER TABLE wq_runs ADD CONSTRAINT wq_runs_lease_iff_running
    CHECK ((state = 'running') = (lease_owner IS NOT NULL));
