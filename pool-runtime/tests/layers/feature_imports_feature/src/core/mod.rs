pub struct Stream;
