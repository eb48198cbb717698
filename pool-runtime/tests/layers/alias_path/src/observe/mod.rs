pub(crate) mod report;
