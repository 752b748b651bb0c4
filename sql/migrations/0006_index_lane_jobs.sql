-- The claim's access path: a lane's due jobs in priority order. procrastinate's own
-- indexes cover (priority, id) over every queue and (queue_name) alone, so without table
-- statistics the claim sorted the whole backlog, other lanes' included (a stranded
-- release's backlog slowed every other lane's claim).
CREATE INDEX wq_jobs_lane_todo_idx
    ON procrastinate_jobs (queue_name, priority DESC, id)
    WHERE status = 'todo';
