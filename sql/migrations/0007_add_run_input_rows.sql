-- How many input rows a run was submitted with, so progress has a total from the start
-- (rows_admitted only grows as the play admits its pages).

ALTER TABLE wq_runs ADD COLUMN input_rows bigint NOT NULL DEFAULT 0;
