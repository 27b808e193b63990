"""The application: the library's operations on a database (the Scheduler service,
views, why, job-file apply, crontab import, cluster status, alert sending)."""
