-- Durable events: the first emit of a name wins and is kept, so a wait that starts after
-- the emit still sees it (no lost wake-up).

CREATE TABLE wq_emitted_events (
    name                text PRIMARY KEY,
    payload             jsonb NOT NULL DEFAULT 'null',
    emitted_at          timestamptz NOT NULL DEFAULT now()
);
